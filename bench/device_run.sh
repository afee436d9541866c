#!/usr/bin/env bash
# One GPU-machine call: build the CUDA core, run the test tiers, run the benchmarks; logs and JSON go to $OUT.
#   bash bench/device_run.sh [all|tests|bench|scale|gemm|run2|swz|run3|run4]      (run from the repository root)
# gemm: grouped GEMM tests + benchmark; run2/swz/run3/run4: this session's measurement runs (bench/RESULTS.md).
# Needs the nvshmem4py cp312 wheel in .whl/ (carried; see README "GPU machine").
set -uo pipefail
mode="${1:-all}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/ep_comm_out}"; mkdir -p "$OUT"
log="$OUT/log.txt"
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
say "mode $mode; $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
nvidia-smi topo -m >> "$log" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())" >> "$log" 2>&1

say "build"
start=$SECONDS
EP_COMM_BUILD_CUDA=1 EP_COMM_CUDA_ARCHS=90a EP_COMM_NVCC_THREADS=16 python3 setup.py -q build_ext --inplace \
  > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
say "built in $((SECONDS - start)) s"
case "$mode" in final*|run4) rm -f "$OUT/build.txt";; esac   # at most 8 files come back
python3 -c "import ep_comm; assert ep_comm.cuda_extension_available(), ep_comm.cuda_extension_error(); print('ep_comm._C ok')" 2>&1 | tee -a "$log"

if [ "$mode" = all ] || [ "$mode" = tests ]; then
  say "gpu tier: formats kernels"
  timeout 120 python3 -m pytest -q -x -rs tests/test_formats_cuda.py > "$OUT/pytest_formats.txt" 2>&1
  tail -25 "$OUT/pytest_formats.txt" | tee -a "$log"
  say "multigpu tier: nvlink smoke (oracle, timeout) with sync checks"
  EP_COMM_SYNC_CHECK=1 timeout 150 python3 -m pytest -q -x -rs tests/test_nvlink.py -k "oracle or timeout" > "$OUT/pytest_nvlink.txt" 2>&1
  tail -25 "$OUT/pytest_nvlink.txt" | tee -a "$log"
  say "multigpu tier: nvlink full + reference over NCCL"
  timeout 240 python3 -m pytest -q -rs tests/test_nvlink.py tests/test_reference_backend.py -k "not oracle and not timeout" >> "$OUT/pytest_nvlink.txt" 2>&1
  tail -25 "$OUT/pytest_nvlink.txt" | tee -a "$log"
fi
if [ "$mode" = bench ]; then
  say "nvlink timeout test"
  EP_COMM_SYNC_CHECK=1 timeout 60 python3 -m pytest -q -x -rs tests/test_nvlink.py -k "timeout" 2>&1 | tail -3 | tee -a "$log"
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  say "bench: formats kernels"
  timeout 150 python3 bench/bench_formats.py --out "$OUT/bench_formats.json" 2>&1 | tail -30 | tee -a "$log"
  say "bench: dispatch/combine"
  timeout 300 python3 bench/bench_dispatch_combine.py --nproc 2 ${EP_COMM_BENCH_ARGS:-} --out "$OUT/bench_dispatch_combine.json" > "$OUT/bench_dispatch_combine.txt" 2>&1
  tail -60 "$OUT/bench_dispatch_combine.txt" | tee -a "$log"
  say "profile: per-kernel time"
  timeout 120 python3 bench/profile_nvlink.py --out "$OUT/profile.json" 2>&1 | grep -v -i warn | grep -v "return func" | tail -25 | tee -a "$log"
  say "main job"
  timeout 110 python3 -m ep_comm.bench --ranks 2 --out "$OUT/bench_main.json" 2>&1 | tail -8 | tee -a "$log"
fi
if [ "$mode" = final ]; then
  # On a 4-GPU machine: the 2-GPU suite and benchmarks on GPUs 0,1, then the 4-GPU suite and benchmark.
  say "2 GPUs: formats kernels"
  CUDA_VISIBLE_DEVICES=0,1 timeout 120 python3 -m pytest -q -x -rs tests/test_formats_cuda.py > "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt" | tee -a "$log"
  say "2 GPUs: nvlink + reference suite"
  CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 -m pytest -q -rs tests/test_nvlink.py tests/test_reference_backend.py -k "not gloo" >> "$OUT/pytest.txt" 2>&1
  tail -12 "$OUT/pytest.txt" | tee -a "$log"
  say "2 GPUs: profile"
  CUDA_VISIBLE_DEVICES=0,1 timeout 90 python3 bench/profile_nvlink.py --out "$OUT/profile.json" 2>&1 | grep -v -i warn | grep -v "return func" | tail -20 | tee -a "$log"
  say "1 GPU: formats bench"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 bench/bench_formats.py --out "$OUT/bench_formats.json" 2>&1 | tail -14 | tee -a "$log"
  say "2 GPUs: dispatch/combine bench"
  CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 bench/bench_dispatch_combine.py --nproc 2 --out "$OUT/bench_dispatch_combine.json" > "$OUT/bench_dc.txt" 2>&1
  grep -E "graph|ceiling" "$OUT/bench_dc.txt" | tee -a "$log"
  say "2 GPUs: main job"
  CUDA_VISIBLE_DEVICES=0,1 timeout 60 python3 -m ep_comm.bench --out "$OUT/bench_main.json" 2>&1 | tail -5 | tee -a "$log"
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 4 ]; then
  say "4 GPUs: nvlink + reference suite"
  timeout 200 python3 -m pytest -q -rs tests/test_nvlink.py tests/test_reference_backend.py -k "not gloo" >> "$OUT/pytest.txt" 2>&1
  tail -8 "$OUT/pytest.txt" | tee -a "$log"
  say "4 GPUs: dispatch/combine bench"
  timeout 100 python3 bench/bench_dispatch_combine.py --nproc 4 --tokens 128,4096 --out "$OUT/bench_dc_4.json" 2>&1 | grep -E "graph|ceiling" | tee -a "$log"
  fi
fi
if [ "$mode" = final2 ]; then
  say "formats kernels (gpu tier)"
  timeout 120 python3 -m pytest -q -rs tests/test_formats_cuda.py > "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt" | tee -a "$log"
  say "nvlink + reference suite (multigpu tier), PDL off (default)"
  timeout 200 python3 -m pytest -q -rs tests/test_nvlink.py tests/test_reference_backend.py -k "not gloo" >> "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt" | tee -a "$log"
  say "nvlink suite, PDL on"
  EP_COMM_NVLINK_PDL=1 timeout 150 python3 -m pytest -q -rs tests/test_nvlink.py -k "oracle or reference or pressure" >> "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt" | tee -a "$log"
  say "formats bench"
  timeout 90 python3 bench/bench_formats.py --out "$OUT/bench_formats.json" 2>&1 | tail -14 | tee -a "$log"
  say "dispatch/combine bench, PDL off (default)"
  timeout 150 python3 bench/bench_dispatch_combine.py --nproc 2 --out "$OUT/bench_dispatch_combine.json" > "$OUT/bench_dc.txt" 2>&1
  grep -E "graph|ceiling|reference .* 4096" "$OUT/bench_dc.txt" | tee -a "$log"
  say "dispatch/combine bench, PDL on"
  EP_COMM_NVLINK_PDL=1 timeout 90 python3 bench/bench_dispatch_combine.py --nproc 2 --tokens 128,4096 --formats nvfp4/s2f6,bf16/bf16 --no-reference --no-ceiling --out "$OUT/bench_dc_pdl.json" 2>&1 | grep graph | tee -a "$log"
  say "profile (per-kernel times)"
  timeout 90 python3 bench/profile_nvlink.py --out "$OUT/profile.json" 2>&1 | grep -v -i warn | grep -v "return func" | tail -20 | tee -a "$log"
  say "main job"
  timeout 60 python3 -m ep_comm.bench --out "$OUT/bench_main.json" 2>&1 | tail -5 | tee -a "$log"
fi
if [ "$mode" = scale ]; then
  n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  say "scale: nvlink + reference tests at world size $n"
  timeout 330 python3 -m pytest -q -rs tests/test_nvlink.py tests/test_reference_backend.py -k "not gloo" > "$OUT/pytest_scale.txt" 2>&1
  tail -15 "$OUT/pytest_scale.txt" | tee -a "$log"
  say "scale: dispatch/combine bench at $n ranks"
  timeout 150 python3 bench/bench_dispatch_combine.py --nproc "$n" --tokens 128,4096 --out "$OUT/bench_scale_$n.json" > "$OUT/bench_scale_$n.txt" 2>&1
  tail -40 "$OUT/bench_scale_$n.txt" | tee -a "$log"
  say "scale: main job at $n ranks"
  timeout 60 python3 -m ep_comm.bench --out "$OUT/bench_main_$n.json" 2>&1 | tail -6 | tee -a "$log"
fi
if [ "$mode" = gemm ]; then
  say "gpu tier: grouped GEMM kernel vs reference"
  timeout 240 python3 -m pytest -q -x -rs tests/test_grouped_gemm.py > "$OUT/pytest_gemm.txt" 2>&1
  tail -30 "$OUT/pytest_gemm.txt" | tee -a "$log"
  say "bench: grouped GEMM (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/bench_grouped_gemm.py --check --out "$OUT/bench_gemm.json" 2>&1 | tail -30 | tee -a "$log"
fi
if [ "$mode" = run2 ]; then
  say "gpu tier: formats kernels"
  timeout 150 python3 -m pytest -q -x -rs tests/test_formats_cuda.py 2>&1 | tail -3 | tee -a "$log"
  say "gpu tier: grouped GEMM (4 and 2 warpgroups per CTA)"
  timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py 2>&1 | tail -2 | tee -a "$log"
  EP_COMM_GEMM_WARPGROUPS=2 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py 2>&1 | tail -2 | tee -a "$log"
  say "multigpu tier: MoE layer (fused experts) + nvlink suite"
  timeout 240 python3 -m pytest -q -rs tests/test_moe.py tests/test_nvlink.py -k "not gloo" > "$OUT/pytest_mg.txt" 2>&1
  tail -4 "$OUT/pytest_mg.txt" | tee -a "$log"
  say "bench: grouped GEMM, 4 warpgroups per CTA (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/bench_grouped_gemm.py --check --token-tiles auto,64 --out "$OUT/bench_gemm.json" 2>&1 | grep -E "^(w1|w2|gemm)|eiling|check:" | tee -a "$log"
  say "bench: grouped GEMM, 2 warpgroups per CTA (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 EP_COMM_GEMM_WARPGROUPS=2 timeout 150 python3 bench/bench_grouped_gemm.py --no-baseline --token-tiles auto,64 --out "$OUT/bench_gemm_wg2.json" 2>&1 | grep -E "^(w1|w2)" | tee -a "$log"
  say "bench: formats kernels (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/bench_formats.py --out "$OUT/bench_formats.json" 2>&1 | tail -16 | tee -a "$log"
  say "bench: dispatch/combine (2 GPUs)"
  timeout 150 python3 bench/bench_dispatch_combine.py --nproc 2 --tokens 128,4096 --formats nvfp4/s2f6,bf16/bf16 --out "$OUT/bench_dc.json" > "$OUT/bench_dc.txt" 2>&1
  grep -E "graph|ceiling|reference" "$OUT/bench_dc.txt" | tail -16 | tee -a "$log"
  say "bench: MoE layer (2 GPUs)"
  timeout 200 python3 bench/bench_moe.py --nproc 2 --iters 5 --out "$OUT/bench_moe.json" 2>&1 | tail -3 | tee -a "$log"
fi
if [ "$mode" = run3 ]; then
  say "gpu tier: formats kernels"
  timeout 150 python3 -m pytest -q -x -rs tests/test_formats_cuda.py 2>&1 | tail -2 | tee -a "$log"
  say "gpu tier: grouped GEMM (default warpgroups by tile, then forced 2 and 4)"
  timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py 2>&1 | tail -2 | tee -a "$log"
  EP_COMM_GEMM_WARPGROUPS=2 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k kernel 2>&1 | tail -1 | tee -a "$log"
  EP_COMM_GEMM_WARPGROUPS=4 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k kernel 2>&1 | tail -1 | tee -a "$log"
  EP_COMM_GEMM_B_SWIZZLE=0 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k kernel 2>&1 | tail -1 | tee -a "$log"
  say "multigpu tier: MoE layer (fused experts) + nvlink suite + reference over NCCL"
  timeout 300 python3 -m pytest -q -rs tests/test_moe.py tests/test_nvlink.py tests/test_reference_backend.py -k "not gloo" > "$OUT/pytest_mg.txt" 2>&1
  tail -4 "$OUT/pytest_mg.txt" | tee -a "$log"
  say "bench: grouped GEMM (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/bench_grouped_gemm.py --check --out "$OUT/bench_gemm.json" 2>&1 | grep -E "^(w1|w2|gemm)|eiling|check:" | tee -a "$log"
  say "bench: MoE layer (2 GPUs)"
  timeout 200 python3 bench/bench_moe.py --nproc 2 --iters 5 --out "$OUT/bench_moe.json" 2>&1 | tail -3 | tee -a "$log"
  say "main job"
  timeout 100 python3 -m ep_comm.bench --out "$OUT/bench_main.json" 2>&1 | tail -5 | tee -a "$log"
fi
if [ "$mode" = run4 ]; then
  # As run on 2026-11-29 ~22:16 UTC. EP_COMM_GEMM_PERSISTENT belonged to an experimental persistent GEMM that was
  # measured slower and not kept (bench/RESULTS.md); with the committed kernel it has no effect.
  say "gpu tier: formats kernels"
  timeout 150 python3 -m pytest -q -x -rs tests/test_formats_cuda.py 2>&1 | tail -2 | tee -a "$log"
  say "gpu tier: grouped GEMM + fused expert MLP (defaults, forced 2 / 4 warpgroups, interleaved B)"
  timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py 2>&1 | tail -2 | tee -a "$log"
  EP_COMM_GEMM_WARPGROUPS=2 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k kernel 2>&1 | tail -1 | tee -a "$log"
  EP_COMM_GEMM_WARPGROUPS=4 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k kernel 2>&1 | tail -1 | tee -a "$log"
  EP_COMM_GEMM_B_SWIZZLE=0 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k kernel 2>&1 | tail -1 | tee -a "$log"
  EP_COMM_GEMM_PERSISTENT=0 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k "kernel or fused" 2>&1 | tail -1 | tee -a "$log"
  say "multigpu tier: MoE layer + nvlink suite + reference over NCCL"
  timeout 300 python3 -m pytest -q -rs tests/test_moe.py tests/test_nvlink.py tests/test_reference_backend.py -k "not gloo" > "$OUT/pytest_mg.txt" 2>&1
  tail -3 "$OUT/pytest_mg.txt" | tee -a "$log"
  say "example: MoE layer on 2 GPUs"
  timeout 120 python3 examples/moe_layer.py 2>&1 | grep rank | tee -a "$log"
  say "bench: formats kernels (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/bench_formats.py --out "$OUT/bench_formats.json" 2>&1 | tail -14 | tee -a "$log"
  say "bench: dispatch/combine (2 GPUs)"
  timeout 150 python3 bench/bench_dispatch_combine.py --nproc 2 --tokens 128,4096 --formats nvfp4/s2f6,bf16/bf16 --out "$OUT/bench_dc.json" > "$OUT/bench_dc.txt" 2>&1
  grep -E "graph|ceiling|reference" "$OUT/bench_dc.txt" | tail -16 | tee -a "$log"
  say "bench: grouped GEMM, persistent (default) and one CTA per item (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/bench_grouped_gemm.py --check --out "$OUT/bench_gemm.json" 2>&1 | grep -E "^(w1|w2|gemm)|eiling|check:" | tee -a "$log"
  CUDA_VISIBLE_DEVICES=0 EP_COMM_GEMM_PERSISTENT=0 timeout 100 python3 bench/bench_grouped_gemm.py --no-baseline --out "$OUT/bench_gemm_nonpersistent.json" 2>&1 | grep -E "^(w1|w2)" | tee -a "$log"
  say "bench: MoE layer (2 GPUs)"
  timeout 150 python3 bench/bench_moe.py --nproc 2 --iters 5 --out "$OUT/bench_moe.json" 2>&1 | tail -3 | tee -a "$log"
fi
if [ "$mode" = swz ]; then
  say "gpu tier: grouped GEMM, 128-byte swizzled B (default) and interleaved B"
  timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py 2>&1 | tail -2 | tee -a "$log"
  EP_COMM_GEMM_B_SWIZZLE=0 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py -k kernel 2>&1 | tail -1 | tee -a "$log"
  say "bench: grouped GEMM swizzled B"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/bench_grouped_gemm.py --check --out "$OUT/bench_gemm.json" 2>&1 | grep -E "^(w1|w2|gemm)|eiling|check:" | tee -a "$log"
  say "bench: grouped GEMM interleaved B"
  CUDA_VISIBLE_DEVICES=0 EP_COMM_GEMM_B_SWIZZLE=0 timeout 150 python3 bench/bench_grouped_gemm.py --no-baseline --out "$OUT/bench_gemm_noswz.json" 2>&1 | grep -E "^(w1|w2)" | tee -a "$log"
  say "multigpu tier: MoE layer"
  timeout 200 python3 -m pytest -q -rs tests/test_moe.py -k "not gloo" 2>&1 | tail -3 | tee -a "$log"
  say "bench: MoE layer (2 GPUs)"
  timeout 200 python3 bench/bench_moe.py --nproc 2 --iters 5 --out "$OUT/bench_moe.json" 2>&1 | tail -3 | tee -a "$log"
fi
say "done"
