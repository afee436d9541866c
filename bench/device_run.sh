#!/usr/bin/env bash
# One GPU-machine call: build the CUDA core, run the GPU test tiers and/or the benchmarks; logs and JSON go to $OUT.
#   bash bench/device_run.sh [all|tests|bench|gemm|scale]      (run from the repository root)
#   bash bench/device_run.sh steps <step> ...                  (any of the step functions below, in order)
#   tests: formats kernels, grouped GEMM (every warpgroup / B-layout variant), MoE + nvlink + NCCL reference
#   bench: formats kernels, dispatch/combine, grouped GEMM, MoE layer, per-kernel profile, main job
#   gemm:  grouped GEMM tests + benchmark;   scale: nvlink tests + benchmark + main job on every visible GPU
# The one-off modes named in bench/RESULTS.md (final, final2, run2, swz, run3, run4) are the versions of this script
# at the commits those sections name (git log -- bench/device_run.sh); they ran the same steps as below.
# Needs the nvshmem4py cp312 wheel in .whl/ (carried; see README "GPU machine").
set -uo pipefail
mode="${1:-all}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/ep_comm_out}"; mkdir -p "$OUT"
log="$OUT/log.txt"
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }

# --- steps ----------------------------------------------------------------------------------------------------
pytest_tier() {  # $1 = name, $2 = timeout s, $3 = summary lines for the log, then pytest arguments; the full output
  local limit="$2" lines="$3" file="$OUT/pytest_$1.txt"  # stays in $OUT only when something failed
  shift 3
  timeout "$limit" python3 -m pytest -q -x -rs "$@" > "$file" 2>&1
  local rc=$?
  tail -"$lines" "$file" | tee -a "$log"
  echo "rc $rc" | tee -a "$log"  # 124: cut off by the timeout; a skip-only tier shows its skips in the kept file
  # Kept (with the skip reasons) unless it passed with no skip and no failure.
  [ "$rc" -eq 0 ] && grep -q " passed" "$file" && ! grep -qE "failed|skipped" "$file" && rm -f "$file"
}
test_formats() {
  say "gpu tier: formats kernels"
  pytest_tier formats 150 2 tests/test_formats_cuda.py tests/test_ext.py
  say "gpu tier: device-only forms of the format primitives, exhaustively (tests/device_checks/device_forms.cu)"
  pytest_tier device_forms 120 2 tests/test_device_forms.py
}
test_ext() {  # the ep_comm._ext helpers alone (raw stream, device context, capture ids): part of test_formats
  say "gpu tier: ep_comm._ext helpers"
  pytest_tier ext 60 2 tests/test_ext.py
}
test_k() {  # an ad-hoc GPU tier: TEST_FILES (default tests/test_grouped_gemm.py), TEST_K (a pytest -k expression)
  say "gpu tier: ${TEST_FILES:-tests/test_grouped_gemm.py} -k '${TEST_K:-}'"
  pytest_tier k 200 3 ${TEST_FILES:-tests/test_grouped_gemm.py} -k "${TEST_K:-}"
}
test_gemm_default() {  # the grouped GEMM tier with the default kernels only (test_ws: the classic-vs-warp-specialized test)
  say "gpu tier: grouped GEMM + fused expert MLP (defaults)"
  timeout 150 python3 -m pytest -q -x tests/test_grouped_gemm.py -k "not warp_specialized" 2>&1 | grep -v "^[.sx]*\( *\[ *[0-9]*%\]\)\?$" | tail -12 | tee -a "$log"
}
test_gemm_fp8() {  # the inexact FP8 mode: its CPU and GPU tests; each kernel case prints its error (largest listed)
  say "gpu tier: grouped GEMM, inexact FP8 mode"
  timeout 200 python3 -m pytest -q -s --maxfail=10 tests/test_grouped_gemm_fp8.py > "$OUT/pytest_gemm_fp8.txt" 2>&1
  echo "rc $?" | tee -a "$log"
  grep -E "passed|failed|error" "$OUT/pytest_gemm_fp8.txt" | tail -3 | tee -a "$log"
  grep -E "relative L2" "$OUT/pytest_gemm_fp8.txt" | awk '{print $NF, $0}' | sort -g | tail -4 | tee -a "$log"
}
test_gemm_variant() {  # $1 = "VAR=value [VAR=value]": the grouped GEMM kernel tests with those variants forced; not
  # the tests that start pytest again under variables of their own (few persistent CTAs, wide tiles: the default tier
  # runs them), whose nested runs (up to 600-900 s each) do not fit a variant's 100 s; test_gemm_items runs the kernel
  # tests on few persistent CTAs under the classic kernel too
  echo "$1:" | tee -a "$log"
  env $1 timeout 100 python3 -m pytest -q -x tests/test_grouped_gemm.py \
    -k "kernel and not warp_specialized and not few_persistent_ctas and not wide_tiles" 2>&1 | tail -1 | tee -a "$log"
}
test_gemm() {  # defaults, then each selectable kernel variant
  test_gemm_default
  test_gemm_variants
  test_gemm_items
  test_ws
}
test_gemm_variants() {  # the kernel tests under each forced classic-kernel variant (~10-45 s each)
  say "gpu tier: grouped GEMM kernels: classic tile 128/144, 2 / 4 warpgroups forced, small-tile shapes, 1 k-block/stage"
  for variant in EP_COMM_GEMM_WS=0 EP_COMM_GEMM_WARPGROUPS=2 EP_COMM_GEMM_WARPGROUPS=4 \
                 EP_COMM_GEMM_SMALL_CTA=1x4 EP_COMM_GEMM_SMALL_CTA=2x2 EP_COMM_GEMM_KBLOCKS_PER_STAGE=1; do
    test_gemm_variant "$variant"
  done
}
test_gemm_items() {  # every launch persistent on a few CTAs: many work items per CTA (ring continued across items)
  say "gpu tier: grouped GEMM kernels on 3 (then classic on 3, then classic on 5 with 1 k-block per stage) persistent CTAs"
  test_gemm_variant EP_COMM_GEMM_MAX_CTAS=3
  test_gemm_variant "EP_COMM_GEMM_WS=0 EP_COMM_GEMM_MAX_CTAS=3"
  test_gemm_variant "EP_COMM_GEMM_MAX_CTAS=5 EP_COMM_GEMM_KBLOCKS_PER_STAGE=1"
}
nvlink_smoke() {
  say "multigpu tier: nvlink smoke (oracle, timeout) with sync checks"
  EP_COMM_SYNC_CHECK=1 timeout 150 python3 -m pytest -q -x -rs tests/test_nvlink.py -k "oracle or timeout" 2>&1 | tail -2 | tee -a "$log"
}
test_nvlink_waves() {  # the dispatch/combine kernels' tiers only: nvlink smoke with sync checks, nvlink suite, waves
  nvlink_smoke
  say "multigpu tier: nvlink suite + waves"
  pytest_tier nvlink_waves 300 4 tests/test_nvlink.py tests/test_waves.py -k "not gloo"
}
test_multigpu() {  # 2+ GPUs: the multigpu tier, one rank per GPU, then the example (one GPU: 2 ranks share it)
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" = 1 ]; then
    test_shared_smoke; test_shared_gpu; return
  fi
  nvlink_smoke
  test_mg_comm
  test_mg_layer
  mg_example
}
# On 2+ GPUs only the tests marked multigpu (42 on 2026-12-06, two of them needing 4 ranks; the gpu and cpu tiers run
# on one GPU and in CI), in two pytest runs with limits of their own and without -x, so that a cut or a failure loses
# little of a scarce 2-GPU call.
# Until 2026-12-05 test_multigpu ran every test of the seven files (150, the gpu tier's world-1 cases included) under
# one 300 s limit; its last 2-GPU run (2026-12-01) took 153 s for the 29 multigpu tests of then.
# A 2-GPU session's plan, one call each, every call's step limits within a 600 s call (build ~35 s): (1) steps
# nvlink_smoke test_mg_comm mg_training_example (150 + 300 + 120 s); (2) steps test_mg_layer
# EP_COMM_PEER_MEMORY=ipc nvlink_smoke mg_fsdp2_example (300 + 150 + 90: the CUDA IPC peer memory between two GPUs,
# never run there -- the 2-GPU runs used NVSHMEM; the FSDP2 example); (3) steps bench_dc_three
# bench_moe (300 + 240); (4) steps main_job mg_example bench_training (110 + 120 + 300). Expected far shorter: on
# 2026-12-01 the smoke, the 29 multigpu tests of then, the example and the dispatch/combine benchmark took 3.7 minutes
# together.
mg_tier() {  # $1 = name, $2 = timeout s, then pytest arguments: the multigpu-marked tests, one rank per visible GPU
  local name="$1" limit="$2"
  shift 2
  kept_tier "$OUT/pytest_mg_$name.txt" "$limit" 8 -m multigpu "$@"
}
test_mg_comm() {  # 2+ GPUs: the nvlink suite (the smoke's 6 cases apart), waves and the device helpers (24 tests,
  # 2 of them skipped below 4 ranks)
  say "multigpu tier: nvlink suite + waves + device helpers"
  mg_tier comm 300 tests/test_nvlink.py tests/test_waves.py tests/test_ext.py -k "not gloo and not oracle and not timeout"
}
test_mg_layer() {  # 2+ GPUs: the MoE layer, the reference backend over NCCL, the training tiers and the training under
  # FSDP2 / DDP (12 tests)
  say "multigpu tier: MoE layer + reference over NCCL + training + FSDP2 / DDP"
  mg_tier layer 300 tests/test_moe.py tests/test_reference_backend.py tests/test_training.py \
    tests/test_training_experts.py tests/test_trainer_wrappers.py -k "not gloo"
}
mg_example() {
  say "example: MoE layer on the visible GPUs"
  timeout 120 python3 examples/moe_layer.py 2>&1 | grep rank | tee -a "$log"
}
mg_training_example() {  # the training example on the visible GPUs: EP over all of them, then replicas of 1 rank each
  say "example: MoE training on the visible GPUs (--expert-parallel all, then 1)"
  timeout 60 python3 examples/moe_training.py --steps 10 2>&1 | tail -3 | tee -a "$log"
  timeout 60 python3 examples/moe_training.py --steps 10 --expert-parallel 1 2>&1 | tail -3 | tee -a "$log"
}
mg_fsdp2_example() {  # the FSDP2 training example on the visible GPUs: EP over all of them, then replicas of 1 rank each
  # with 2 micro-batches and BF16 parameters
  say "example: MoE training under FSDP2 on the visible GPUs (EP over all; replicas of 1 rank, 2 micro-batches, BF16)"
  timeout 45 python3 examples/moe_fsdp2.py --steps 10 --max-grad-norm 0.05 2>&1 | tail -3 | tee -a "$log"
  timeout 45 python3 examples/moe_fsdp2.py --steps 10 --expert-parallel 1 --micro-batches 2 --bf16 2>&1 | tail -3 \
    | tee -a "$log"
}
test_nvlink_layer() {  # the nvlink, MoE-layer and waves tiers in one pytest run (stops at the first failure)
  say "multigpu tier: nvlink + MoE layer + waves"
  pytest_tier layer 240 3 tests/test_nvlink.py tests/test_moe.py tests/test_waves.py -k "not gloo"
}
bench_small_twice() { bench_ab EP_COMM_NVLINK_PDL auto 1,128,4096; }  # two rounds of the default at 1 / 128 / 4096 tokens
test_waves() {
  say "multigpu tier: waves (wave dispatch + w1 behind its receive, bitwise the plain path; timeout)"
  pytest_tier waves 240 3 tests/test_waves.py
}
test_gemm_stage1() { test_gemm_variant EP_COMM_GEMM_KBLOCKS_PER_STAGE=1; }
test_moe() {
  say "multigpu tier: MoE layer (fused experts, CUDA-graph replay)"
  timeout 200 python3 -m pytest -q -rs tests/test_moe.py -k "gpus" 2>&1 | tail -3 | tee -a "$log"
}
bench_moe_waves() { bench_moe --wave-sms auto,8,15,32,66; }  # the waves layer at its default and other receive SMs
bench_formats() {
  say "bench: formats kernels (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/bench_formats.py --out "$OUT/bench_formats.json" 2>&1 | tail -16 | tee -a "$log"
}
bench_router() {  # the router's FP32 logits + top-k against tensor-core forms of the same product (time, top-k agreement)
  say "bench: router top-k forms (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/bench_router.py --out "$OUT/bench_router.json" 2>&1 | tail -14 | tee -a "$log"
}
bench_training() {  # ep_comm.training: forward + backward against the forward Buffer calls (nvlink, every GPU up to 2)
  say "bench: training autograd (forward + backward through dispatch / combine)"
  timeout 300 python3 bench/bench_training.py --profile --out "$OUT/bench_training.json" 2>&1 | tail -70 | tee -a "$log"
}
bench_training_input_grad() {  # one GPU: the training step's backward with a BF16 and an MXFP8 input-gradient combine
  say "bench: training autograd at world 1, input gradient combined in bf16, then mxfp8"
  for fmt in bf16 mxfp8; do
    timeout 200 python3 bench/bench_training.py --nproc 1 --tokens 128,4096 --layer-experts 0 --shared-intermediate 0 \
      --input-grad-format "$fmt" --out "$OUT/bench_training_igrad_$fmt.json" 2>&1 | grep "rank 0" | tee -a "$log"
  done
}
bench_formats_shapes() {  # NVFP4 quantize under each thread shape (tuning; ours only)
  for shape in ${QUANT_SHAPES:-wide occupancy narrow}; do
    say "bench: NVFP4 quantize, EP_COMM_NVFP4_QUANT_SHAPE=$shape"
    EP_COMM_NVFP4_QUANT_SHAPE=$shape CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/bench_formats.py --no-reference \
      --only nvfp4_quantize 2>&1 | grep nvfp4_quantize | tee -a "$log"
  done
}
test_formats_shapes() {  # the NVFP4 quantize tests under the non-default thread shapes
  for shape in ${QUANT_SHAPES:-wide occupancy narrow}; do
    echo "EP_COMM_NVFP4_QUANT_SHAPE=$shape:" | tee -a "$log"
    EP_COMM_NVFP4_QUANT_SHAPE=$shape timeout 100 python3 -m pytest -q -x tests/test_formats_cuda.py \
      -k "nvfp4 or four_over_six or edge" 2>&1 | tail -1 | tee -a "$log"
  done
}
bench_dc() {  # $1 = ranks; further arguments go to the benchmark
  local ranks="$1"; shift
  say "bench: dispatch/combine ($ranks GPUs)"
  timeout 300 python3 bench/bench_dispatch_combine.py --nproc "$ranks" "$@" --out "$OUT/bench_dc_$ranks.json" > "$OUT/bench_dc_$ranks.txt" 2>&1
  grep -E "graph|ceiling|reference|nccl " "$OUT/bench_dc_$ranks.txt" | tail -30 | tee -a "$log"
}
bench_world1() {  # one GPU: dispatch/combine and the MoE layer at world 1 (the local work only: no token crosses NVLink)
  bench_dc 1 --tokens 128,4096 --formats nvfp4/s2f6,bf16/bf16 --no-reference --no-ceiling
  say "bench: MoE layer at world 1 (128 experts, all local)"
  # 20 iterations: the eager rows at 128 tokens are host-bound, and medians of 5 once came out 1.5-15x high (sixty-third
  # session: dispatch 1.413 ms, 0.077-0.121 with 30 iterations)
  timeout 240 python3 bench/bench_moe.py --nproc 1 --experts 128 --iters 20 --out "$OUT/bench_moe_world1.json" 2>&1 \
    | tail -14 | tee -a "$log"
}
bench_combine_formats_world1() {  # one GPU: the three combine formats after an NVFP4 dispatch, world 1 (local work only)
  bench_dc 1 --tokens 128,4096 --formats nvfp4/s2f6,nvfp4/mxfp8,nvfp4/bf16 --no-reference --no-ceiling
}
bench_floor() {  # small-call latency: NVFP4/S2F6 and BF16 at 1, 16 and 128 tokens, then the per-kernel profile at 1 and 128
  bench_dc 2 --tokens 1,16,128 --formats nvfp4/s2f6,bf16/bf16 --no-reference --no-ceiling
  say "profile: per-kernel time, 1 and 128 tokens"
  timeout 120 python3 bench/profile_nvlink.py --tokens 1,128 --formats nvfp4/s2f6 --out "$OUT/profile_floor.json" 2>&1 \
    | grep -E "^ *[0-9]+ " | tee -a "$log"
}
bench_dc_nvfp4() { bench_dc 2 --tokens 128,4096 --formats nvfp4/s2f6; }
bench_dc_both() { bench_dc 2 --tokens 128,4096 --formats nvfp4/s2f6,bf16/bf16; }
bench_dc_three() {  # 2 GPUs: as bench_dc_both, plus the MXFP8 combine (never timed between GPUs yet)
  bench_dc 2 --tokens 128,4096 --formats nvfp4/s2f6,nvfp4/mxfp8,bf16/bf16
}
bench_dc_quick() { bench_dc 2 --tokens 128,1024,4096 --formats nvfp4/s2f6,bf16/bf16 --no-reference --no-ceiling; }
bench_pdl() {  # A/B: programmatic dependent launch on and off (EP_COMM_NVLINK_PDL), small and large calls
  bench_ab EP_COMM_NVLINK_PDL "1 0" 1,128,4096
}
bench_pdl_auto() {  # A/B: the default choice (combine always, dispatch up to 512 tokens) against none, 256-1024 tokens
  bench_ab EP_COMM_NVLINK_PDL "auto 0" 256,512,1024
}
bench_ab() {  # $1 = variable, $2 = "value ...", $3 = tokens[, $4 = formats]: graph figures for each value, two rounds
  # (raw rows of every run merged into $OUT/ab_<variable>.json: {value: {round: rows}})
  local var="$1" values="$2" tokens="$3" formats="${4:-nvfp4/s2f6}" tmp
  tmp=$(mktemp -d)
  for round in 1 2; do
    for value in $values; do
      say "bench: $formats dispatch / combine, $var=$value (round $round)"
      env "$var=$value" timeout 120 python3 bench/bench_dispatch_combine.py --nproc "${AB_NPROC:-2}" --tokens "$tokens" \
        --formats "$formats" --no-reference --no-ceiling --out "$tmp/${value}_$round.json" > "$OUT/bench_ab.txt" 2>&1
      grep -E "nvlink +(dispatch|dispatch_rows|combine) .* graph" "$OUT/bench_ab.txt" | tee -a "$log" || tail -5 "$OUT/bench_ab.txt" | tee -a "$log"
    done
  done
  python3 - "$tmp" "$OUT/ab_$var.json" <<'PY'
import json, os, sys
merged = {}
for name in sorted(os.listdir(sys.argv[1])):
    value, rnd = name[:-len(".json")].rsplit("_", 1)
    merged.setdefault(value, {})[rnd] = json.load(open(os.path.join(sys.argv[1], name)))
json.dump(merged, open(sys.argv[2], "w"), indent=1)
PY
  rm -rf "$tmp" "$OUT/bench_ab.txt"
}
bench_stream_recv() {  # A/B: the streaming dispatch receive on and off, NVFP4 and BF16, small and large calls
  bench_ab EP_COMM_NVLINK_STREAM_RECV "1 0" 128,1024,4096 nvfp4/s2f6,bf16/bf16
}
bench_compact_copy() {  # A/B: split rows copied by the short loop (default) or the unrolled one; AB_NPROC=1 on one GPU
  bench_ab EP_COMM_NVLINK_COMPACT_COPY "1 0" 1,128,512,4096 nvfp4/s2f6,bf16/bf16
}
bench_bf16_sms() {  # the BF16 dispatch at 4096 tokens with 16 / 24 / 32 / 48 send blocks (is the send SM-bound?)
  for sms in 16 24 32 48; do
    say "bench: BF16 dispatch / combine, --num-sms $sms"
    timeout 120 python3 bench/bench_dispatch_combine.py --nproc 2 --tokens 4096 --formats bf16/bf16 --num-sms "$sms" \
      --no-reference --no-ceiling --out "$OUT/bench_sms_$sms.json" 2>&1 | grep -E "nvlink +(dispatch|combine) .* graph" | tee -a "$log"
  done
}
profile_4096() {
  say "profile: per-kernel time, 4096 tokens"
  timeout 120 python3 bench/profile_nvlink.py --tokens 4096 --formats nvfp4/s2f6,bf16/bf16 --out "$OUT/profile_4096.json" 2>&1 \
    | grep -E "^ *[0-9]+ " | tee -a "$log"
}
bench_direct_self() { bench_ab EP_COMM_DIRECT_SELF_MIN_TOKENS "0 1000000000" 128,512,1024,2048,4096; }
test_nvlink_one_rank() {  # the nvlink suite's workers on one rank (all rows are the rank's own): a 1-GPU check
  say "gpu tier: nvlink workers at world size 1 (reference comparison, direct self rows, block counts, pressure + graph, streaming, dispatches in flight, waves)"
  (cd tests && timeout 300 python3 -c "
from harness import run_ranks
import test_nvlink as t
run_ranks(t.versus_reference_worker, 1, backend='nccl', timeout_s=280)
run_ranks(t.versus_reference_worker, 1, 0, backend='nccl', timeout_s=280)
run_ranks(t.block_counts_worker, 1, backend='nccl', timeout_s=280)
r = run_ranks(t.pressure_and_graph_worker, 1, backend='nccl', timeout_s=280)
run_ranks(t.streaming_pressure_and_graph_worker, 1, backend='nccl', timeout_s=280)
run_ranks(t.misuse_worker, 1, backend='nccl', timeout_s=280)
run_ranks(t.sync_check_graph_worker, 1, backend='nccl', timeout_s=280)
run_ranks(t.rows_worker, 1, backend='nccl', timeout_s=280)
import dist_cases
assert run_ranks(dist_cases.check_finite_worker, 1, 'nvlink', 'cuda', backend='nccl', timeout_s=280) == ['check_finite ok']
for direct_self in (None, 0):
    assert run_ranks(dist_cases.in_flight_worker, 1, 'nvlink', 'cuda', direct_self, backend='nccl', timeout_s=280) == ['in flight ok']
import test_waves as tw
w = run_ranks(tw._waves_worker, 1, backend='nccl', timeout_s=280)[0]
assert w['backend'] == 'nvlink', w['backend']
tw.check_waves_result(w)
assert r[0]['memset'] == 'ok', r[0]
print('world 1 nvlink workers passed', r[0]['graph'], r[0]['leak'], 'region', r[0]['region'], 'memsets', r[0]['memset'],
      'waves duplicate ids:', w['duplicate_ids'])
" 2>&1 | tail -4 | tee -a "$log")
}
profile_host() {  # host (CPU) microseconds per eager dispatch / combine call at world 1, and a cProfile of the Python path
  say "profile: host cost per eager call (world 1)"
  timeout 200 python3 bench/profile_host.py --nproc 1 --moe-experts 32 --out "$OUT/profile_host.json" \
    > "$OUT/profile_host.txt" 2>&1
  grep -E "us per call" "$OUT/profile_host.txt" | tee -a "$log"
}
profile_host_small() {  # host-bound shapes (16 tokens, H = 2048, 16 experts): where an eager MoELayer forward's host time goes
  say "profile: host cost per eager call, small shapes (world 1)"
  timeout 200 python3 bench/profile_host.py --nproc 1 --tokens 16 --hidden 2048 --experts 16 --moe-experts 16 \
    --calls 300 --top 45 --out "$OUT/profile_host_small.json" > "$OUT/profile_host_small.txt" 2>&1
  grep -E "us per call" "$OUT/profile_host_small.txt" | tee -a "$log"
}
check_2gpu_quick() {  # on 2 GPUs, little device time: the nvlink reference comparison (all formats, special tokens)
  # and the MXFP8 / NVFP4 / BF16 dispatch + combine graph timings at 4096 tokens
  say "gpu tier (2 GPUs): nvlink against the reference"
  pytest_tier nvlink_ref 200 2 tests/test_nvlink.py -k "matches_reference"
  say "bench: dispatch / combine graph, 2 ranks, 4096 tokens"
  AB_FORMATS=mxfp8/s2f6,nvfp4/s2f6,bf16/bf16 AB_TOKENS=4096 dc_graph_rows 2>&1 | grep -E "$dc_graph_pattern" | tee -a "$log"
}
profile_host_small_ab() {  # profile_host_small's host µs per call (dispatch, combine, MoELayer forward), this tree against
  # ab_base.tar (this, base, base, this)
  ab_trees "profile: host cost, small shapes" "us per call" env CUDA_VISIBLE_DEVICES=0 timeout 100 \
    python3 bench/profile_host.py --nproc 1 --tokens 16 --hidden 2048 --experts 16 --moe-experts 16 --calls 300
}
profile_host_ab() {  # host µs per eager call at 128 tokens, this tree against ab_base.tar (this, base, base, this)
  ab_trees "profile: host cost, 128 tokens" "us per call" env CUDA_VISIBLE_DEVICES=0 timeout 100 \
    python3 bench/profile_host.py --nproc 1 --tokens 128 --calls 500
}
kept_tier() {  # $1 = output file, $2 = timeout s, $3 = summary lines for the log, then pytest arguments: no -x, and
  # the whole output kept (with the exit status; 124: cut off by the timeout)
  local file="$1" limit="$2" lines="$3"
  shift 3
  timeout "$limit" python3 -m pytest -q -rs --durations=8 "$@" > "$file" 2>&1
  echo "rc $?" >> "$file"
  grep -E "passed|failed|error|skipped|SKIPPED|rc " "$file" | tail -"$lines" | tee -a "$log"
}
shared_tier() {  # $1 = name, $2 = timeout s, then pytest arguments: multigpu tests with 2 ranks sharing GPU 0
  local name="$1" limit="$2"
  shift 2
  EP_COMM_TEST_SHARED_GPU=1 CUDA_VISIBLE_DEVICES=0 kept_tier "$OUT/pytest_shared_$name.txt" "$limit" 6 "$@"
}
shared_k() {  # SHARED_K: a pytest -k expression over SHARED_FILES (default tests/test_nvlink.py), 2 ranks sharing GPU 0
  say "multigpu tier, 2 ranks sharing one GPU: ${SHARED_FILES:-tests/test_nvlink.py} -k '${SHARED_K}'"
  shared_tier k 300 ${SHARED_FILES:-tests/test_nvlink.py} -k "$SHARED_K"
}
test_shared_smoke() {  # one GPU: the nvlink smoke (oracle cases, timeouts) with 2 ranks on it and sync checks
  say "multigpu tier, 2 ranks sharing one GPU (gloo, CUDA IPC, time-sliced): nvlink smoke with sync checks"
  EP_COMM_SYNC_CHECK=1 shared_tier smoke 200 tests/test_nvlink.py -k "oracle or timeout"
}
test_shared_gpu() {  # one GPU: the multigpu tiers with 2 ranks on it (the multi-rank protocol; correctness only)
  say "multigpu tiers, 2 ranks sharing one GPU: nvlink suite, MoE layer, waves"
  test_shared_nvlink
  test_shared_layer
}
test_shared_nvlink() {  # one GPU, 2 ranks on it: the nvlink suite (the smoke's cases apart)
  shared_tier nvlink 420 tests/test_nvlink.py -k "not oracle and not timeout"
}
test_shared_layer() {  # one GPU: the MoE layer, waves, reference-backend and training tiers with 2 ranks on it
  # (60 tests took 320 s on an H200 on 2026-12-05, 64 over 480 s on an H100 later that day: so two tiers with their
  # own limits; give them a call of their own)
  test_shared_moe
  test_shared_rest
}
test_shared_moe() {  # one GPU, 2 ranks on it: the MoE layer and waves tiers
  shared_tier layer 300 tests/test_moe.py tests/test_waves.py -k "not gloo"
}
test_shared_rest() {  # one GPU, 2 ranks on it: the reference-backend and training tiers (217 s of 240 on 2026-12-05
  # before the pipeline-schedule worker joined the training tier's multigpu test: 360)
  shared_tier layer_rest 360 tests/test_reference_backend.py tests/test_training.py -k "not gloo"
}
test_training_experts() {  # ep_comm.training.ExpertMLP (NVFP4 forward, MXFP8 + SR backward) against its FP32 oracle,
  # and its weight-gradient GEMM (csrc/grouped_wgrad.cu)
  say "gpu tier: trainable experts (ExpertMLP) on nvlink at world 1"
  pytest_tier training_experts 300 2 tests/test_training_experts.py tests/test_grouped_wgrad.py -m gpu
  say "multigpu tier, 2 ranks sharing one GPU: trainable experts"
  shared_tier training_experts 300 tests/test_training_experts.py -m multigpu
}
bench_training_experts() {  # ExpertMLP forward + backward against BF16 torch._grouped_mm autograd, one GPU
  say "bench: trainable experts (ExpertMLP) vs BF16 grouped-GEMM autograd"
  timeout 300 python3 bench/bench_training_experts.py --profile --out "$OUT/bench_training_experts.json" 2>&1 \
    | tail -30 | tee -a "$log"
  timeout 200 python3 bench/bench_training_experts.py --master-dtype bfloat16 \
    --out "$OUT/bench_training_experts_bf16_masters.json" 2>&1 | tail -3 | tee -a "$log"
}
profile_seed_forms() {  # the trainable experts' step with an int seed and a seed tensor: GPU time, kernels, gaps
  say "profile: trainable experts' step, int seed vs seed tensor"
  timeout 300 python3 bench/profile_seed_forms.py --out "$OUT/profile_seed_forms.json" 2>&1 | tail -6 | tee -a "$log"
}
test_training() {  # ep_comm.training (autograd through dispatch / combine) on the nvlink backend: world 1, then 2 ranks
  # sharing GPU 0 (the multigpu test; on 2+ GPUs test_multigpu runs it one rank per GPU)
  say "gpu tier: ep_comm.training gradients on nvlink at world 1"
  pytest_tier training 200 2 tests/test_training.py -m gpu
  say "multigpu tier, 2 ranks sharing one GPU: ep_comm.training gradients"
  shared_tier training 300 tests/test_training.py -m multigpu
}
test_trainer_wrappers() {  # ep_comm.training under FSDP2 (fp32, bf16 parameters, accumulation) and DDP, bitwise the
  # hand-averaged steps, training.clip_grad_norm_ there, a distributed checkpoint: world 1 on the nvlink backend (NCCL;
  # 12 tests, ~100 s on one H100). The CPU forms (CI's) are test_trainer_wrappers_cpu: together they ran past 300 s
  # on 2026-12-06.
  say "gpu tier: training under FSDP2 / DDP, clipping, checkpoint"
  pytest_tier trainer_wrappers 300 2 tests/test_trainer_wrappers.py -m gpu
}
test_trainer_wrappers_cpu() {  # the same file's CPU forms (gloo, 2 and 4 ranks) and the FSDP2 example's tests
  say "cpu tier: training under FSDP2 / DDP, clipping, checkpoints, the FSDP2 example"
  pytest_tier trainer_wrappers_cpu 500 2 tests/test_trainer_wrappers.py tests/test_examples.py -m cpu -k "wrapped or fsdp2 or checkpoint or ep_mesh or clip"
}
test_comm_stream() {  # ep_comm.training on a comm_stream (eager and captured, ExpertMLP too) and the stream bookkeeping:
  # world 1, then 2 ranks sharing GPU 0
  say "gpu tier: ep_comm.training on a comm_stream, graphs"
  pytest_tier comm_stream 240 3 tests/test_training.py tests/test_training_experts.py tests/test_buffer_streams.py \
    -k "comm_stream or cuda_graph or tensors_in"
  say "multigpu tier, 2 ranks sharing one GPU: ep_comm.training on a comm_stream, graphs"
  shared_tier comm_stream 300 tests/test_training.py tests/test_training_experts.py -k "comm_stream or cuda_graph"
}
test_untested() {  # the GPU tests written in the fifty-eighth session without a GPU (2026-12-04): nvlink weight edges
  # and calls without tokens (2 ranks sharing GPU 0), _block_values bit for bit, the FP8 GEMM row by row, and the
  # comm_stream tier (its review mends and ExpertMLP's later wait)
  say "gpu tier: tests written without a GPU (fifty-eighth session)"
  SHARED_K="weight_edges" shared_k
  pytest_tier untested 200 3 tests/test_training_experts.py tests/test_grouped_gemm_fp8.py \
    -k "block_values_kernel or kernel_vs_fp8_reference"
  test_comm_stream
}
bench_training_comm() {  # the shared-expert rows of bench_training (serial, comm_stream, comm kernels capped) with the
  # host profiles, one rank
  say "bench: training with a shared expert beside a comm_stream dispatch"
  timeout 300 python3 bench/bench_training.py --nproc 1 --tokens 128,4096 --layer-experts 0 --profile \
    --out "$OUT/bench_training_comm.json" 2>&1 | grep "rank 0" | tee -a "$log"
}
test_shared_worlds() {  # one GPU: the nvlink oracle cases (every format pair, masked / skewed / all-to-one routing, an
  # empty rank; bitwise the single-process oracle) with 4, then 8 ranks sharing it. (The reference comparison, with
  # H up to 7168, did not finish within 240 s at 4 ranks on 2026-12-01: time-slicing 4+ contexts is far slower than 2.)
  for ranks in 4 8; do
    say "multigpu tier, $ranks ranks sharing one GPU: nvlink oracle cases"
    EP_COMM_TEST_SHARED_WORLD=$ranks shared_tier "world$ranks" 150 tests/test_nvlink.py -k "oracle"
  done
}
test_shared_world_reference() {  # $1 = ranks sharing one GPU, $2 = timeout s: the nvlink reference comparison (4 ranks
  # did not finish in 240 s on 2026-12-01 when every rank's torch used all 16 cores; the launcher now gives each rank
  # its share; 4 and 8 ranks passed in 15.6 / 25.7 s in the twenty-fifth session)
  say "multigpu tier, $1 ranks sharing one GPU: nvlink reference comparison"
  EP_COMM_TEST_SHARED_WORLD=$1 shared_tier "world$1_reference" "$2" tests/test_nvlink.py -k "matches_reference"
}
test_shared_world4_reference() { test_shared_world_reference 4 400; }
test_shared_ep_groups() {  # one GPU, 4 ranks sharing it: two expert-parallel groups of 2 (blocked, strided), each
  # against an EP world of 2 alone, and dispatches in flight at world 4 (passed on one H100, 2026-12-05: 3 tests, 68 s)
  say "multigpu tier, 4 ranks sharing one GPU: EP groups inside a larger world, dispatches in flight"
  EP_COMM_TEST_SHARED_WORLD=4 shared_tier ep_groups 300 tests/test_nvlink.py -k "expert_parallel_groups or in_flight"
}
test_shared_world8_reference() { test_shared_world_reference 8 300; }
test_formats_large() {  # 64-bit index arithmetic and launch-shape edges of the format kernels (up to 14 GiB each)
  say "gpu tier: format kernels at sizes past 32-bit indices"
  pytest_tier formats_large 300 2 tests/test_formats_cuda_large.py
}
bench_rows_one_rank() {  # world 1: dispatch (expanded) against dispatch(expand=False), graph, 128 and 4096 tokens
  say "bench: dispatch expanded vs rows-only (expand=False), world 1"
  bench_dc 1 --tokens 128,4096 --formats nvfp4/s2f6,bf16/bf16 --no-reference --no-ceiling
}
test_moe_one_rank() {  # the MoE layer's GPU worker at world size 1 (fused experts, combine rows): a 1-GPU check
  say "gpu tier: MoE layer worker at world size 1"
  (cd tests && timeout 300 python3 -c "
from harness import run_ranks
import test_moe as t
for routing in t.ROUTINGS:
    for r in run_ranks(t._moe_worker, 1, 'cuda', 'auto', routing, backend='nccl', timeout_s=280):
        t.check_routing(r)
        t.check_gpu_moe_result(r, True)
    print('world 1 MoE worker passed,', routing, 'routing', r['rows_per_expert'], r['backend'], r['expert_impl'],
          r['combine_rows']['equal_to_combine'], 'vs oracle / other mode', r['vs_oracle'], r['vs_other_mode'],
          'rows', r['combine_rows']['vs_oracle'], r['combine_rows']['vs_other_mode'])
for e in run_ranks(t._moe_edge_worker, 1, 'cuda', backend='nccl', timeout_s=280):
    t.check_moe_edge_result(e, 0, 1, 1e-2)
    assert e['backend'] == 'nvlink' and e['expert_impl'] == 'fused', (e['backend'], e['expert_impl'])
print('world 1 MoE edge worker (top-1, 0 tokens, transposed x) passed', e['backend'], e['expert_impl'])
for f in run_ranks(t._moe_fp8_worker, 1, 'cuda', backend='nccl', timeout_s=280):
    print('world 1 MoE FP8 worker:', {k: v for k, v in f.items() if k.startswith('vs_')})
    t.check_moe_fp8_result(f)
print('world 1 MoE FP8 worker passed')
" 2>&1 | tail -8 | tee -a "$log")
}
test_moe_one_rank_mxfp8() {  # the MoE layer's GPU worker at world size 1 on a Buffer with the MXFP8 combine
  say "gpu tier: MoE layer worker at world size 1, MXFP8 combine"
  (cd tests && timeout 200 python3 -c "
from harness import run_ranks
import test_moe as t
for routing in t.ROUTINGS:
    for r in run_ranks(t._moe_worker, 1, 'cuda', 'auto', routing, 'mxfp8', backend='nccl', timeout_s=180):
        t.check_routing(r)
        t.check_gpu_moe_result(r, True)
    print('world 1 MoE worker (MXFP8 combine) passed,', routing, r['backend'], r['expert_impl'], 'vs oracle / other mode',
          r['vs_oracle'], r['vs_other_mode'], 'vs fp32', r['vs_fp32'])
" 2>&1 | tail -3 | tee -a "$log")
}
test_nvlink() {
  say "multigpu tier: nvlink suite"
  pytest_tier nvlink 400 3 tests/test_nvlink.py
}
bench_gemm() {  # arguments go to the benchmark
  say "bench: grouped GEMM (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 250 python3 bench/bench_grouped_gemm.py --check --rows 128,16,256r "$@" --out "$OUT/bench_gemm.json" 2>&1 | grep -E "^(w1|w2|mlp|gemm|==)|eiling|check:|parts" | tee -a "$log"
}
bench_gemm_tail_ab() {  # the remainder launch overlapped with the main one (EP_COMM_GEMM_TAIL_OVERLAP) on and off, routed rows
  for value in 1 0 0 1; do bench_gemm_variant EP_COMM_GEMM_TAIL_OVERLAP=$value 256r; done
}
bench_gemm_wide_ab() {  # wide last tiles (EP_COMM_GEMM_WIDE_TILE=144) on and off, routed ~256 rows per expert
  for value in 144 0 0 144; do bench_gemm_variant EP_COMM_GEMM_WIDE_TILE=$value 256r; done
}
test_ws() {  # the warp-specialized GEMM of tiles 128 / 144 (the default) bitwise the classic one (EP_COMM_GEMM_WS=0)
  say "gpu tier: grouped GEMM, warp-specialized form against the classic kernel"
  pytest_tier ws 560 25 tests/test_grouped_gemm.py -k warp_specialized
}
test_ws_layer() {  # the classic tile-128 kernel behind a wave receive (w1 of the MoE layer) and with combine rows:
  # the waves tier with 2 ranks sharing GPU 0 and EP_COMM_GEMM_WS=0 (the default tiers run the warp-specialized form
  # there; the MoE layer worker of test_moe_one_rank takes tile 32 and reaches neither)
  say "gpu tier: the waves tier with the classic tile-128 GEMM (EP_COMM_GEMM_WS=0)"
  EP_COMM_GEMM_WS=0 shared_tier classic_waves 300 tests/test_waves.py -k "bitwise_the_plain"
}
bench_moe_ws_ab() {  # the MoE layer at world 1 (4096 tokens, 128 experts) with the classic and the warp-specialized
  # GEMMs (w1 behind the wave receive, w2 with combine rows), in the order classic, ws, ws, classic
  local value
  for value in 0 1 1 0; do
    say "bench: MoE layer at world 1, EP_COMM_GEMM_WS=$value"
    EP_COMM_GEMM_WS=$value CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/bench_moe.py --nproc 1 --experts 128 \
      --tokens 4096,128 --iters 5 --no-baseline 2>&1 | tail -14 | tee -a "$log"
  done
}
bench_gemm_ws_ab() {  # the tile-128/144 GEMM: classic, warp-specialized (the default), twice each
  for value in 0 1 1 0; do bench_gemm_variant EP_COMM_GEMM_WS=$value "${GEMM_AB_ROWS:-128,256r}"; done
}
bench_gemm_small_persistent() {  # the small token tiles as persistent CTAs (EP_COMM_GEMM_MAX_CTAS=396: 3 per SM) or not
  for value in 0 396 396 0; do bench_gemm_variant EP_COMM_GEMM_MAX_CTAS=$value 16,32; done
}
bench_requant_shapes() {  # the w2-input requantization (fp32 rows -> operand rows, 4/6) under each quantize thread shape
  for shape in auto occupancy wide auto; do
    say "bench: requantization into operand rows, EP_COMM_NVFP4_QUANT_SHAPE=$shape"
    (cd bench && EP_COMM_NVFP4_QUANT_SHAPE=$shape CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -c "
import torch
from ep_comm import grouped_gemm as G
from bench_formats import time_ms
for rows in (16384, 32857):
    x = torch.randn(rows, 2048, device='cuda') * 3.0
    ms = time_ms(lambda: G.quantize_expanded_rows(x, impl='cuda'), 20, 5)
    print(f'requant {rows} x 2048 fp32: {ms * 1e3:.1f} us')
") 2>&1 | grep requant | tee -a "$log"
  done
}
bench_gemm_variant() {  # $1 = VAR=value, $2 = rows (default 128,16,256r): ours only, in the table lines of the log
  say "bench: grouped GEMM with $1, rows ${2:-128,16,256r}"
  env "$1" CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/bench_grouped_gemm.py --rows "${2:-128,16,256r}" \
    --no-baseline 2>&1 | grep -E "^(w1|w2|mlp) " | tee -a "$log"
}
bench_gemm_cta_shapes() {  # the tile-128 CTA shape at GEMM_AB_ROWS (default 128): default, 2 warpgroups x 2 CTAs, one
  local v  # k-block per stage, default again (order: drift favours neither)
  for v in EP_COMM_GEMM_WIDE_TILE=144 EP_COMM_GEMM_WARPGROUPS=2 EP_COMM_GEMM_KBLOCKS_PER_STAGE=1 EP_COMM_GEMM_WIDE_TILE=144; do
    bench_gemm_variant "$v" "${GEMM_AB_ROWS:-128}"
  done
}
bench_gemm_stage1() { bench_gemm_variant EP_COMM_GEMM_KBLOCKS_PER_STAGE=1; }
bench_gemm_tiles() { bench_gemm --token-tiles auto,64 --rows 128,16,256r,256; }
ncu_gemm_launch() {  # $1 = w1|w2, $2 = rows per expert, then ncu's options: Nsight Compute on the second grouped GEMM
  local gemm="$1" rows="$2"  # launch of bench/profile_gemm.py (the first is the warm-up), report on stdout
  shift 2
  CUDA_VISIBLE_DEVICES=0 timeout 200 ncu --kernel-name regex:grouped_gemm --launch-skip 1 --launch-count 1 "$@" \
    python3 bench/profile_gemm.py --gemm "$gemm" --rows "$rows"
}
profile_gemm() {  # Nsight Compute on one w1 launch at 16 and at 128 rows per expert
  say "profile: ncu grouped GEMM"
  for rows in 16 128; do
    ncu_gemm_launch w1 "$rows" --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section SourceCounters >> "$OUT/ncu_gemm.txt" 2>&1
    echo "ncu rows $rows: rc $?" | tee -a "$log"
  done
}
profile_gemm_stalls() {  # GEMM_PROFILE = w1|w2 (default w2), GEMM_PROFILE_ROWS (default 128): stall reasons and per-SASS-line
  local gemm="${GEMM_PROFILE:-w2}" rows="${GEMM_PROFILE_ROWS:-128}"  # stall samples of the second launch (ncu)
  say "profile: ncu grouped GEMM stalls, $gemm at $rows rows per expert"
  ncu_gemm_launch "$gemm" "$rows" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section SourceCounters \
    --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    > "$OUT/ncu_gemm_stalls_${gemm}_$rows.txt" 2>&1
  echo "ncu gemm stalls $gemm $rows: rc $?" | tee -a "$log"
  ncu_gemm_launch "$gemm" "$rows" --section SourceCounters --page source --print-source sass --csv \
    > "$OUT/ncu_gemm_sass_${gemm}_$rows.csv" 2>&1
  echo "ncu gemm sass $gemm $rows: rc $?" | tee -a "$log"
  python3 bench/ncu_sass_summary.py "$OUT/ncu_gemm_sass_${gemm}_$rows.csv" > "$OUT/ncu_gemm_sass_${gemm}_${rows}_summary.txt" 2>&1
  head -8 "$OUT/ncu_gemm_sass_${gemm}_${rows}_summary.txt" | tee -a "$log"
}
profile_gemm_pipes() {  # GEMM_PROFILE = w1|w2 (default both), GEMM_PROFILE_ROWS (default 128): tensor / ALU pipe utilisation and
  local gemm rows="${GEMM_PROFILE_ROWS:-128}"  # the instruction mix of the second launch (ncu)
  for gemm in ${GEMM_PROFILE:-w1 w2}; do
    say "profile: ncu grouped GEMM pipes, $gemm at $rows rows per expert"
    ncu_gemm_launch "$gemm" "$rows" --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section InstructionStats --section Occupancy \
      --metrics regex:"sm__pipe_.*(tensor|alu|fma|fp16|shared).*_cycles_active\.avg\.pct_of_peak_sustained_active",regex:"sm__inst_executed_pipe_.*\.sum$" \
      > "$OUT/ncu_gemm_pipes_${gemm}_$rows.txt" 2>&1
    echo "ncu gemm pipes $gemm $rows: rc $?" | tee -a "$log"
    grep -E "Duration|SM Frequency|pipe_.*pct|Issue Slots Busy|Executed Ipc Active" "$OUT/ncu_gemm_pipes_${gemm}_$rows.txt" | tee -a "$log"
  done
}
profile_wgrad() {  # Nsight Compute on the weight-gradient GEMM (csrc/grouped_wgrad.cu), its second launch at the w2 shape
  say "profile: wgrad GEMM"
  python3 bench/profile_wgrad.py 2>&1 | tail -2 | tee -a "$log"
  PROFILE_WGRAD_TIME=0 CUDA_VISIBLE_DEVICES=0 timeout 200 ncu --kernel-name regex:grouped_wgrad --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --metrics regex:"sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active",regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 bench/profile_wgrad.py > "$OUT/ncu_wgrad.txt" 2>&1
  echo "ncu wgrad: rc $?" | tee -a "$log"
  grep -E "Duration|Throughput|pipe_tensor|Issue Slots Busy|stalled_(long|barrier|wait|math|lg|mio|short|dispatch|no_inst|membar|sleep).*ratio|Hit Rate|Achieved Occupancy" \
    "$OUT/ncu_wgrad.txt" | tee -a "$log"
  grep -E "Grid Size|Cluster|Registers Per|Block Limit" "$OUT/ncu_wgrad.txt" | tee -a "$log"
}
time_wgrad() {  # the weight-gradient GEMM's time at w2's and w1's backward shapes, with the environment's choices
  say "wgrad GEMM time (EP_COMM_WGRAD_GEMM=${EP_COMM_WGRAD_GEMM:-})"
  python3 bench/profile_wgrad.py 2>&1 | tail -1 | tee -a "$log"
  python3 bench/profile_wgrad.py --m 4096 --n 7168 2>&1 | tail -1 | tee -a "$log"
}
profile_wgrad_sass() {  # per-SASS-line stall samples of the weight-gradient GEMM (second launch, w2 shape)
  say "profile: wgrad GEMM stalls per SASS line"
  PROFILE_WGRAD_TIME=0 CUDA_VISIBLE_DEVICES=0 timeout 200 ncu --kernel-name regex:grouped_wgrad --launch-skip 1 \
    --launch-count 1 --section SourceCounters --page source --print-source sass --csv \
    python3 bench/profile_wgrad.py > "$OUT/ncu_wgrad_sass.csv" 2>&1
  echo "ncu wgrad sass: rc $?" | tee -a "$log"
  python3 bench/ncu_sass_summary.py "$OUT/ncu_wgrad_sass.csv" --top 25 > "$OUT/ncu_wgrad_sass_summary.txt" 2>&1
  head -60 "$OUT/ncu_wgrad_sass_summary.txt" | tee -a "$log"
  rm -f "$OUT/ncu_wgrad_sass.csv"
}
profile_formats() {  # Nsight Compute on the second launch of each quantization kernel (64 MiB inputs)
  say "profile: ncu formats kernels"
  CUDA_VISIBLE_DEVICES=0 timeout 200 ncu --kernel-name regex:"quantize|accumulate|transposed" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section InstructionStats python3 bench/profile_formats.py --mib 64 "$@" > "$OUT/ncu_formats.txt" 2>&1
  echo "ncu formats: rc $?" | tee -a "$log"
}
# Same-call A/B against a base tree: ab_base.tar in the repository root (`git archive -o ab_base.tar <commit>`; ignored
# by git, so carry it: carry [".whl", "ab_base.tar"]) is built once in /tmp/ab_base_<content hash>; the steps below run this
# tree and that one in the order this, base, base, this (drift over the call does not favour either). Another archive
# for the steps after it: the step AB_BASE=<file.tar> (any VAR=value step is exported; see "steps" at the end).
# Named after the archive's content, not its name: /tmp survives between calls while the machine stays warm, and a
# re-archived ab_base.tar must not reuse the build of the one before.
ab_base_dir() { echo "/tmp/ab_base_$(sha1sum "${AB_BASE:-ab_base.tar}" | cut -c1-12)"; }
ab_base_build() {
  local tar="${AB_BASE:-ab_base.tar}" dir
  dir=$(ab_base_dir)
  [ -f "$dir/.built" ] && return 0
  say "build: base tree ($tar)"
  rm -rf "$dir" && mkdir -p "$dir" && tar -xf "$tar" -C "$dir" || return 1
  (cd "$dir" && EP_COMM_BUILD_CUDA=1 EP_COMM_CUDA_ARCHS=90a EP_COMM_NVCC_THREADS=16 python3 setup.py -q build_ext \
    --inplace > /tmp/ab_base_build.txt 2>&1) || { tail -20 /tmp/ab_base_build.txt | tee -a "$log"; return 1; }
  touch "$dir/.built"
}
ab_trees() {  # $1 = label, $2 = a grep -E pattern for the lines to keep, then a command run in each tree (cwd, PYTHONPATH)
  local label="$1" keep="$2" tree out base
  shift 2
  ab_base_build || return
  base=$(ab_base_dir)
  out=$(mktemp)
  for tree in "$PWD" "$base" "$base" "$PWD"; do
    say "$label: $( [ "$tree" = "$PWD" ] && echo this || echo "base ${AB_BASE:-ab_base.tar}" ) tree"
    (cd "$tree" && PYTHONPATH="/tmp/site:$tree" "$@") > "$out" 2>&1
    grep -E "$keep" "$out" | tee -a "$log" || tail -5 "$out" | tee -a "$log"  # nothing matched: show why
  done
  rm -f "$out"
}
negative_control() {  # NEG_K = a pytest -k expression over tests/test_nvlink.py, run in the tree of NEG_BASE (default
  # AB_BASE: an archive of a tree with a known defect) with 2 ranks sharing GPU 0: the tests must FAIL there
  local AB_BASE="${NEG_BASE:-${AB_BASE:-ab_base.tar}}"  # seen by ab_base_dir / ab_base_build (dynamic scope)
  ab_base_build || return
  local base file="$OUT/pytest_negative_control.txt"
  base=$(ab_base_dir)
  say "negative control: -k '${NEG_K}' in the base tree $AB_BASE (must fail)"
  (cd "$base" && PYTHONPATH="/tmp/site:$base" EP_COMM_TEST_SHARED_GPU=1 CUDA_VISIBLE_DEVICES=0 timeout 240 \
    python3 -m pytest -q -rs tests/test_nvlink.py -k "$NEG_K") > "$file" 2>&1
  echo "rc $?" >> "$file"
  grep -E "passed|failed|Error|assert|rc " "$file" | tail -8 | tee -a "$log"
}
bench_formats_ab() {  # AB_ONLY: the kernels to time (bench_formats --only, a name substring; default nvfp4_quantize);
  # AB_HIDDEN: the row width (default 7168)
  local only="${AB_ONLY:-nvfp4_quantize}"
  ab_trees "bench: $only, hidden ${AB_HIDDEN:-7168}" "$only|copy_" env CUDA_VISIBLE_DEVICES=0 timeout 60 \
    python3 bench/bench_formats.py --no-reference --only "$only" --hidden "${AB_HIDDEN:-7168}"
}
env_ab() {  # $1 = label, then a command (a step function too): run in this tree under AB_VAR = each of AB_VALUES
  # (defaults EP_COMM_NVFP4_PREFETCH, "on off"), alternating a b b a
  local var="${AB_VAR:-EP_COMM_NVFP4_PREFETCH}" values="${AB_VALUES:-on off}" label="$1" value
  local first="${values%% *}" second="${values##* }"
  shift
  for value in "$first" "$second" "$second" "$first"; do
    say "$label, $var=$value"
    (export "$var=$value"; "$@")
  done
}
formats_rows() {  # the AB_ONLY kernels (default nvfp4_quantize) at AB_HIDDEN (default 7168), with the copy rows
  local only="${AB_ONLY:-nvfp4_quantize}" out
  out=$(mktemp)
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/bench_formats.py --no-reference --only "$only" \
    --hidden "${AB_HIDDEN:-7168}" > "$out" 2>&1
  grep -E "$only|copy_" "$out" | tee -a "$log" || tail -5 "$out" | tee -a "$log"
  rm -f "$out"
}
bench_formats_env_ab() {  # formats_rows under AB_VAR = each of AB_VALUES (env_ab: default the prefetch on / off)
  env_ab "bench: ${AB_ONLY:-nvfp4_quantize}, hidden ${AB_HIDDEN:-7168}" formats_rows
}
quantize_host_env_ab() {  # quantize_host_parts under the prefetch on / off (env_ab). Each 4/6 launch with more CTAs
  # than SMs queries the occupancy on the host for the prefetch distance (not cached): ~0.5-0.8 us per launch past one
  # wave (eighty-first session, bench/RESULTS.md)
  env_ab "bench: eager 4/6 quantize host cost" quantize_host_parts
}
quantize_host_parts() {  # where an eager 4/6 quantize call's host µs go: allocations, the compiled launch, the internal and
  # public Python calls, a torch add for scale, and a cProfile of the public call (bench/profile_quantize_host.py)
  say "bench: eager 4/6 quantize host cost by layer"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/profile_quantize_host.py 2>&1 | tee -a "$log"
}
quantize_host_parts_ab() {  # quantize_host_parts in this tree against ab_base.tar (this, base, base, this)
  ab_trees "bench: eager quantize host cost by layer" "host us per call" env CUDA_VISIBLE_DEVICES=0 timeout 120 \
    python3 bench/profile_quantize_host.py
}
# The nvlink graph rows of a dispatch/combine run in the current directory's tree: AB_FORMATS (default nvfp4/s2f6;
# several: "nvfp4/s2f6,bf16/bf16"), AB_TOKENS (default 128,1024,4096), AB_NPROC (ranks, default 2).
dc_graph_rows() {
  timeout 120 python3 bench/bench_dispatch_combine.py --nproc "${AB_NPROC:-2}" --tokens "${AB_TOKENS:-128,1024,4096}" \
    --formats "${AB_FORMATS:-nvfp4/s2f6}" --no-reference --no-ceiling
}
dc_graph_pattern="nvlink +(dispatch|dispatch_rows|combine) .* graph"
bench_training_ab() {  # ep_comm.training forward + backward (identity experts, world 1), this tree against ab_base.tar;
  # AB_LAYER_EXPERTS (default 0: off) adds the whole layer with ExpertMLP
  ab_trees "bench: training autograd, ${AB_TOKENS:-128,4096} tokens" "^rank 0 tokens" env CUDA_VISIBLE_DEVICES=0 \
    timeout 200 python3 bench/bench_training.py --nproc 1 --layer-experts "${AB_LAYER_EXPERTS:-0}" \
    --tokens "${AB_TOKENS:-128,4096}"
}
bench_dc_ab() { ab_trees "bench: dispatch / combine ${AB_FORMATS:-nvfp4/s2f6}" "$dc_graph_pattern" dc_graph_rows; }
bench_gemm_ab() {  # the grouped GEMM kernels (ours only) in this tree and in ab_base.tar: GEMM_AB_ROWS (default 128,16)
  ab_trees "bench: grouped GEMM ${GEMM_AB_ROWS:-128,16}" "^(w1|w2|mlp) " env CUDA_VISIBLE_DEVICES=0 timeout 150 \
    python3 bench/bench_grouped_gemm.py --rows "${GEMM_AB_ROWS:-128,16}" --no-baseline
}
bench_dc_trees() {  # BISECT_TARS="a.tar b.tar ..." (git archives, carried): this tree, then each archive's, one run each
  local tar dir
  say "bench: dispatch / combine ${AB_FORMATS:-nvfp4/s2f6}: this tree"
  dc_graph_rows 2>&1 | grep -E "$dc_graph_pattern" | tee -a "$log"
  for tar in ${BISECT_TARS:-}; do
    AB_BASE="$tar" ab_base_build || continue
    dir=$(AB_BASE="$tar" ab_base_dir)
    say "bench: dispatch / combine ${AB_FORMATS:-nvfp4/s2f6}: $tar"
    (cd "$dir" && PYTHONPATH="/tmp/site:$dir" dc_graph_rows 2>&1) | grep -E "$dc_graph_pattern" | tee -a "$log"
  done
}
profile_nvfp4_quantize() { profile_formats --only nvfp4_quantize; }  # executed instructions of the two NVFP4 quantizers
profile_transposed() { profile_formats --only transposed; }  # where the transposed requantization's time goes
profile_stalls() {  # STALLS_ONLY = a bench_formats case name substring (default transposed), STALLS_KERNEL = the kernel name regex (the last launch of 2): stall reasons and
  local only="${STALLS_ONLY:-transposed}" name  # per-SASS-line stall samples (ncu)
  name="${only//[^A-Za-z0-9]/_}"
  say "profile: ncu stall reasons, $only"
  CUDA_VISIBLE_DEVICES=0 timeout 200 ncu --kernel-name regex:"${STALLS_KERNEL:-transposed}" --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section Occupancy --section InstructionStats \
    --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 bench/profile_formats.py --mib 64 --only "$only" > "$OUT/ncu_stalls_$name.txt" 2>&1
  echo "ncu stalls $only: rc $?" | tee -a "$log"
  CUDA_VISIBLE_DEVICES=0 timeout 200 ncu --kernel-name regex:"${STALLS_KERNEL:-transposed}" --launch-skip 1 --launch-count 1 \
    --section SourceCounters --page source --print-source sass --csv \
    python3 bench/profile_formats.py --mib 64 --only "$only" > "$OUT/ncu_sass_$name.csv" 2>&1
  echo "ncu sass $only: rc $?" | tee -a "$log"
  # per-line summary with the thread instructions per element (the input's elements from the benchmark's own shape)
  python3 bench/ncu_sass_summary.py "$OUT/ncu_sass_$name.csv" \
    --elements "$(python3 bench/profile_formats.py --mib 64 --print-elements)" > "$OUT/ncu_sass_${name}_summary.txt" 2>&1
  grep -A1 "^thread instructions per element" "$OUT/ncu_sass_${name}_summary.txt" | tee -a "$log"
}
profile_comm_ncu() {  # Nsight Compute on one dispatch + combine at 4096 tokens on ONE rank (world 1: no peer to wait for under
  # replay), per format pair in COMM_FORMATS (default nvfp4/s2f6 bf16/bf16): the 4 kernels of the second call pair
  local pair name
  for pair in ${COMM_FORMATS:-nvfp4/s2f6 bf16/bf16}; do
    name="${pair//\//_}"
    say "profile: ncu dispatch/combine kernels, world 1, 4096 tokens, $pair"
    CUDA_VISIBLE_DEVICES=0 timeout 240 ncu --target-processes all \
      --kernel-name regex:"dispatch_send|dispatch_recv|combine_send|combine_recv" --launch-skip 6 --launch-count 4 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section SchedulerStats \
      --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 bench/profile_nvlink.py --nproc 1 --tokens 4096 --formats "$pair" --iters 1 > "$OUT/ncu_comm_$name.txt" 2>&1
    echo "ncu comm $pair: rc $?" | tee -a "$log"
    grep -E "^  [a-z_]+_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|long_scoreboard_per|Warp Cycles Per Issued" "$OUT/ncu_comm_$name.txt" | tee -a "$log"
  done
}
profile_small_stalls() {  # ncu stall reasons of the five kernels of one NVFP4/S2F6 call pair at world 1 (SMALL_STALLS_TOKENS,
  # default 1; skip 13 = profile_nvlink's first dispatch and two warm-up pairs), caches flushed before each kernel (ncu's
  # default) and not flushed: how much of a small call is instruction fetch (stalled_no_instruction)
  local cache tokens="${SMALL_STALLS_TOKENS:-1}"
  for cache in all none; do
    say "profile: ncu stall reasons, world 1, $tokens tokens, nvfp4/s2f6, --cache-control $cache"
    CUDA_VISIBLE_DEVICES=0 timeout 200 ncu --target-processes all --cache-control "$cache" \
      --kernel-name regex:"layout_kernel|dispatch_send|dispatch_recv|combine_send|combine_recv" --launch-skip 13 \
      --launch-count 5 --section WarpStateStats \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 bench/profile_nvlink.py --nproc 1 --tokens "$tokens" --formats nvfp4/s2f6 --iters 1 \
      > "$OUT/ncu_small_stalls_${tokens}_$cache.txt" 2>&1
    echo "ncu small stalls $tokens tokens, cache $cache: rc $?" | tee -a "$log"
    grep -E "^  [a-z_:<>0-9A-Za-z ,()]*kernel|gpu__time_duration.sum|smsp__inst_executed.sum|stalled_(no_instruction|long_scoreboard|membar|barrier|wait|branch_resolving|lg_throttle|short_scoreboard)_per_issue_active|Warp Cycles Per Issued" \
      "$OUT/ncu_small_stalls_${tokens}_$cache.txt" | tee -a "$log"
  done
}
profile_one_rank_ab() {  # per-kernel device time of dispatch + combine at world 1 (one GPU; all rows local), this tree
  # against ab_base.tar: the local kernels' A/B when only one GPU is lent
  ab_trees "profile: world 1, 4096 tokens" "^ +4096 " env CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/profile_nvlink.py \
    --nproc 1 --tokens 4096 --formats nvfp4/s2f6,bf16/bf16 --iters 20
}
profile_one_rank_send() {  # world 1, 4096 tokens, NVFP4: per-kernel times with the direct self rows on (default) and off
  # (off: the send writes one staging row per token, as for one peer), then ncu stall reasons of the send with them off
  local v
  for v in 2048 1000000000; do
    say "profile: world 1, 4096 tokens, nvfp4/s2f6, EP_COMM_DIRECT_SELF_MIN_TOKENS=$v"
    EP_COMM_DIRECT_SELF_MIN_TOKENS=$v CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/profile_nvlink.py --nproc 1 \
      --tokens 4096 --formats nvfp4/s2f6 --iters 20 2>&1 | grep -E "^ +4096 |kernel" | tee -a "$log"
  done
  EP_COMM_DIRECT_SELF_MIN_TOKENS=1000000000 CUDA_VISIBLE_DEVICES=0 timeout 240 ncu --target-processes all \
    --kernel-name regex:"dispatch_send" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    --section SourceCounters --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 bench/profile_nvlink.py --nproc 1 --tokens 4096 --formats nvfp4/s2f6 --iters 1 > "$OUT/ncu_send_noself.txt" 2>&1
  echo "ncu send (no direct self rows): rc $?" | tee -a "$log"
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" \
    "$OUT/ncu_send_noself.txt" | tee -a "$log"
}
profile_4096_timeline() {  # both ranks' kernels of the last dispatch + combine of a graph replay at 4096 tokens
  say "profile: timeline of a 4096-token dispatch + combine (graph replay)"
  timeout 150 python3 bench/profile_nvlink.py --timeline --tokens 4096 --formats nvfp4/s2f6,bf16/bf16 --iters 4 \
    --out "$OUT/profile_4096_timeline.json" 2>&1 | grep -E "timeline|rank [01]" | tee -a "$log"
}
bench_moe() {  # arguments go to the benchmark
  say "bench: MoE layer (2 GPUs)"
  timeout 240 python3 bench/bench_moe.py --nproc 2 --iters 5 "$@" --out "$OUT/bench_moe.json" 2>&1 | tail -14 | tee -a "$log"
}
profile_moe() {  # the kernel timeline of one MoE layer forward at 4096 tokens per rank (rank 0), waves and not
  for waves in 1 0; do
    say "profile: MoE layer kernel timeline, waves=$waves"
    timeout 200 python3 bench/profile_moe.py --waves "$waves" --out "$OUT/profile_moe_waves$waves.json" \
      > "$OUT/profile_moe_waves$waves.txt" 2>&1
    echo "profile_moe waves=$waves: rc $?" | tee -a "$log"
  done
}
profile_small_timeline() {  # both ranks' kernels of the last dispatch + combine of a graph replay, 1 and 128 tokens
  say "profile: timeline of a small dispatch + combine (graph replay)"
  timeout 150 python3 bench/profile_nvlink.py --timeline --tokens 1,128 --formats nvfp4/s2f6 --iters 10 \
    --out "$OUT/profile_small_timeline.json" 2>&1 | grep -E "timeline|rank [01]" | tee -a "$log"
}
profile_nvlink() {
  say "profile: per-kernel time"
  timeout 120 python3 bench/profile_nvlink.py --out "$OUT/profile.json" 2>&1 | grep -v -i warn | grep -v "return func" | tail -25 | tee -a "$log"
}
main_job() {
  say "main job"
  timeout 110 python3 -m ep_comm.bench --out "$OUT/bench_main.json" 2>&1 | tail -6 | tee -a "$log"
}

# --- setup and build ------------------------------------------------------------------------------------------
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
rm -f "$OUT/build.txt"   # at most 8 files come back from a device call
python3 -c "import ep_comm; assert ep_comm.cuda_extension_available(), ep_comm.cuda_extension_error(); print('ep_comm._C ok')" 2>&1 | tee -a "$log"
# Without the extension every gpu test would skip and read like a pass: stop here instead.
python3 -c "import ep_comm, sys; sys.exit(0 if ep_comm.cuda_extension_available() else 1)" || { say "ep_comm._C unavailable: stopping"; exit 1; }

# --- modes ----------------------------------------------------------------------------------------------------
case "$mode" in
  tests) test_formats; test_formats_large; test_gemm; test_multigpu ;;
  bench) bench_formats; bench_dc_both; bench_gemm; bench_moe; profile_nvlink; main_job ;;
  all) test_formats; test_formats_large; test_gemm; test_multigpu
       bench_formats; bench_dc_both; bench_gemm; bench_moe; main_job ;;
  gemm) test_gemm; bench_gemm ;;
  steps) shift; for step in "$@"; do case "$step" in *=*) export "$step" ;; *) "$step" ;; esac; done ;;
  scale)
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    say "scale: nvlink + MoE + reference tests at world size $n"
    timeout 330 python3 -m pytest -q -rs tests/test_nvlink.py tests/test_moe.py tests/test_reference_backend.py -k "not gloo" > "$OUT/pytest_scale.txt" 2>&1
    tail -15 "$OUT/pytest_scale.txt" | tee -a "$log"
    bench_dc "$n" --tokens 128,4096
    main_job ;;
  *) echo "unknown mode $mode (all|tests|bench|gemm|scale|steps <step> ...)" >&2; exit 2 ;;
esac
say "done"
