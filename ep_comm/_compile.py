"""The library's boundary for torch.compile: its public entry points run eagerly inside a compiled model."""
import torch


def eager_only(function):
    """Decorator: under torch.compile, `function` and everything it calls run eagerly, with a graph break before and
    after the call; the caller's own code around it is still compiled. Eagerly called, it costs ~0.5 us per call.

    Why the library is not compiled:
    * the formats are bit-exact rules (docs/NUMERICS.md), written in the reference as chains of fp32 torch operations;
      inductor would generate its own code for them, whose bits nothing here tests, and torch 2.13's CPU code
      generator cannot build some of them at all (the torch.float8_e8m0fnu bitcasts of the MXFP8 and S2F6 scales
      raise an InductorError);
    * on GPUs the CUDA kernels do the work, so there is nothing to gain;
    * dispatch and combine are collectives with host-side agreement, device-side state and, on the reference backend,
      shapes that depend on the routing: traced, they would only break the graph in many places and recompile.
    `torch.compile(..., fullgraph=True)` around a call of these raises at compile time (dynamo names the disabled
    function) instead of compiling part of it."""
    # Never on a function that is already disabled, nor on a wrapper of one (functools.wraps copies the inner
    # function's dynamo attributes): torch before 2.11 unwraps such a stack to the innermost function and would skip
    # what the outer wrappers do (formats._keeps_subnormals, which applies this itself, is one).
    if getattr(function, "_torchdynamo_orig_callable", None) is not None:
        raise TypeError(f"{function.__qualname__} is already eager_only (or wraps a function that is)")
    return torch.compiler.disable(function, recursive=True)
