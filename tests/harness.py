"""The tests' spawn harness is the package's own launcher (ep_comm.launch)."""
from ep_comm.launch import GPU_ENV, free_port, run_ranks  # noqa: F401
