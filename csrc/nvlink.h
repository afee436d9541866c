// NVLink dispatch/combine: shared types and device helpers of the three kernel families
// (nvlink_layout.cu, nvlink_dispatch.cu, nvlink_combine.cu) and their host launchers (bind_nvlink.cpp).
//
// Torch-free: Python computes the symmetric-region layout (ep_comm/backends/nvlink.py, `_RegionLayout`),
// allocates every tensor and passes raw device addresses; nothing here allocates.
//
// Protocol (one symmetric region per rank, same offsets everywhere, peers reached by plain pointers):
//   flags      disp_ready[W]    my region, slot s: blocks of source s that finished writing their rows to me
//              disp_consumed[W] my region, slot d: blocks of dest d that finished reading my rows
//              comb_ready[W]    my region, slot e: blocks of expert rank e that finished writing rows to me
//              comb_consumed[W] my region, slot s: blocks of source s that finished reading my rows
//              disp_counts[W]   my region, slot s: dispatch calls whose counts source s has written to me
//              comb_desc[W]     my region, slot e: what expert rank e's latest combine rows to me belong to
//                               (combine_descriptor: the dispatch word of the handle it combined -- that
//                               dispatch's epoch and its Buffer's tag -- and local_reduce), stored before its
//                               comb_ready signal (combine rows: by the wait-only send after its wait, and the
//                               receive's publish adds comb_ready after a system fence, below). The receive compares
//                               each with its own and records a fault on a mismatch: the ranks combined different
//                               dispatches' handles (of one Buffer or of two) or disagreed on local_reduce, so the rows
//                               are not what it reads them as. Epochs 2^40 apart, or two Buffers whose 22-bit tags
//                               collide, are not told apart
//   abort      u32 (spin_wait.cuh): nonzero once this rank gave up (a timeout or a fault) or a peer told it that it
//              gave up (nvlink_give_up.cu); every wait then fails at once. After a failed wait a sender stores nothing
//              more (fail-stop), so a peer that is only slow times out instead of reading a later call's rows
//   counts     [W][count_stride] int32: source s writes its per-local-expert row counts, its token count and
//              whether its rows of this call carry row flags (1 / 0)
//   staging    [W][T_max] dispatch rows (payload | metadata), slot chosen by the sender's prefix sum
//   combine    [T_max][K] combine rows, indexed by (token, rank ordinal) or (token, top-k slot)
//   wave index [W][E_local][T_max] int32: source s writes, for its p-th row to local expert j, the staging slot of
//              that token (the inverse of the slot table), so that a wave receive can write rows expert by expert
//   row flags  [W][T_max] u32: source s stores the low 32 bits of the call's epoch at [s][j] once staging row j (payload
//              and metadata) is complete (release, system scope), so that a streaming receive expands rows as they
//              arrive instead of after the whole send (below). (A flag left from exactly k * 2^32 calls earlier, on a
//              slot not written in between, would pass as fresh: not guarded, 2^32 dispatches of one Buffer apart)
// Every counter only grows: each block of the signalling kernel adds 1 per call, so "epoch n is complete"
// is counter >= n * (blocks of the kernel that signals that array):
//   disp_ready    <- dispatch send blocks    (cfg.disp_send_blocks), waited on by dispatch receive
//   disp_consumed <- dispatch receive blocks (cfg.disp_recv_blocks), waited on by dispatch send
//   comb_ready    <- combine send blocks     (cfg.comb_send_blocks; combine rows: the receive's publish adds the
//                    same share at once), waited on by combine receive
//   comb_consumed <- combine receive blocks  (cfg.comb_recv_blocks), waited on by combine send
//   disp_counts   <- one dispatch send block per call (the first to start), waited on by the dispatch send's
//                    direct self rows and by the streaming receive (its own counts, then every peer's; below)
// Direct self rows (NVFP4, not a wave dispatch; DispatchArgs::direct_self): the send stores the rows a rank sends to
// itself straight into its expert-major output (handle included) instead of its own staging area, once every
// source's counts are in (the output offsets depend on them); the receive then expands only the other sources' rows.
// The counts writer is the send block that starts first in the call (a ticket, not block 0), so the wait for counts
// never depends on a block that is not yet resident.
// Streaming receive (DispatchArgs::stream_recv, not a wave dispatch): the receive kernel is launched as the send's
// programmatic dependent and does not wait for the send grid to finish. It takes its epoch from a start ticket, waits
// only for every source's counts (which every source writes after its own griddepcontrol.wait, so nothing before the
// dispatch on this stream is still running once they are in -- the receive writes its outputs only after that), then
// waits for each staging row's flag before expanding it. A source that wrote no row flags (its send split rows across
// warps in a small call, or it does not stream; its counts say which) has its rows taken once its whole send has
// signalled disp_ready. Before its last signal (disp_consumed) the receive's last block to start executes
// griddepcontrol.wait: the grid completes only after its own send, as stream order requires of the dispatch's last
// kernel, and the other blocks retire as soon as they are done.
// The block counts are fixed per Buffer and identical on every rank (Python agrees on them). A kernel waits on
// another block of its own grid only for the counts, whose writer has already started (above), so grids larger than
// the SM count are safe. Epochs (calls) are counted on the device (NvlinkState) so CUDA-graph replays
// advance them. A writer first waits until the reader has consumed the previous epoch's rows (the
// *_consumed counters), so buffers are reused without memsets and without races whatever the call
// pattern (dispatch twice in a row, combine twice with one handle, ...), as long as every rank makes
// the same sequence of calls.
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

#include "pdl_launch.cuh"
#include "spin_wait.cuh"
#include "waves.h"

namespace ep_comm {
namespace nvlink {

enum DispatchFormat : int { kDispNvfp4 = 0, kDispMxfp8 = 1, kDispBf16 = 2 };
enum CombineFormat : int { kCombS2f6 = 0, kCombBf16 = 1, kCombMxfp8 = 2 };

// Stages named in the error word (Python turns them into text).
enum Stage : int {
  kStageDispatchWaitConsumed = 1,  // dispatch send: peer still reading the previous dispatch's rows
  kStageDispatchWaitReady = 2,     // dispatch receive: peer's rows never arrived
  kStageCombineWaitConsumed = 3,   // combine send: peer still reading the previous combine's rows
  kStageCombineWaitReady = 4,      // combine receive: peer's rows never arrived
  // 5 = kStageWaveWaitRows (waves.h): the w1 GEMM waited too long for a wave's rows
  kStageDispatchWaitCounts = 6,    // dispatch send (direct self rows): peer's counts never arrived
  kStageRowPastCapacity = 7,       // dispatch: a row's place fell outside [0, R) (counts and rows of different calls
                                   // after a timeout, or a token with one expert in two slots and check_inputs off)
  // 8 = kStagePeerGaveUp (spin_wait.cuh): the peer named in the word gave up and set this rank's abort word
  kStageCombineMismatch = 9,       // combine receive: the peer's rows belong to another dispatch's handle or to the
                                   // other local_reduce mode (comb_desc)
};

constexpr int kMaxTopk = 32;    // one lane per top-k slot in several warp-level steps
constexpr int kBufferTagBits = 22;      // NvlinkConfig::buffer_tag < 2^22 (dispatch_word)
constexpr int kDispatchEpochBits = 40;  // the epoch's share of a handle's dispatch word (dispatch_word)
constexpr int kMaxWorld = 1024;  // ranks of one NVLink domain (NVL72 needs 72); static shared arrays
constexpr int kLayoutMaxChunks = 64;  // layout blocks per call (chunks of consecutive tokens)
constexpr int kLayoutMinChunkTokens = 16;
// Dynamic shared memory a block of these kernels may take: the layout kernel's per-warp histograms (at least one warp,
// layout_warp_smem) and the dispatch kernels' receive layout (receive_layout_smem). 200 KiB leaves the kernels' static
// arrays room under the 227 KiB a block can have. The Python side refuses a configuration whose tables do not fit
// before it allocates anything (ep_comm/backends/nvlink.py _check_nvlink_limits, with these values: bind_nvlink.cpp).
constexpr int kMaxDynamicSmem = 200 * 1024;

// Tokens per layout chunk for a call with `num_tokens` tokens (host and device agree through DispatchArgs).
inline int layout_chunk_tokens(int num_tokens) {
  const int per = (num_tokens + kLayoutMaxChunks - 1) / kLayoutMaxChunks;
  return per > kLayoutMinChunkTokens ? per : kLayoutMinChunkTokens;
}

// Device-resident per-Buffer state (zeroed once at creation; local memory, never touched by peers).
struct NvlinkState {
  unsigned long long disp_epoch;  // dispatch calls started (bumped by the layout kernel)
  // Combine tickets (one launch of each combine kernel per call): send blocks started, all calls, a wait-only launch
  // counting for a whole grid; receive blocks started, all calls. ticket / grid + 1 is the call's epoch.
  unsigned long long comb_send_tickets;
  unsigned long long comb_recv_tickets;
  unsigned int layout_done_blocks;  // layout blocks finished in the current call (last one scans)
  unsigned long long send_arrivals;  // dispatch send blocks started, all calls (ticket % grid == 0: counts writer)
  // Dispatch receive tickets: each call's receive blocks add cfg.disp_recv_blocks in all (a wave receive on fewer blocks
  // shares it out), so ticket / disp_recv_blocks + 1 is the call's epoch without waiting for the layout kernel.
  unsigned long long disp_recv_tickets;
  // Epoch of the last dispatch whose receive kept its staging rows for the caller (DispatchArgs::row_index: no
  // expansion, the rows are the result). That receive does not signal disp_consumed; the next dispatch's send does,
  // before it waits on the peers (so a CUDA graph mixing both kinds replays correctly: decided on the device).
  unsigned long long held_epoch;
};

// Static description of one Buffer: geometry, region offsets and device addresses. Passed by value.
struct NvlinkConfig {
  int rank;
  int world;
  int hidden;
  int num_experts;
  int num_local;     // experts per rank
  int topk;
  int max_tokens;    // T_max
  int alignment;     // expert segment alignment (rows)
  int disp_send_blocks;  // grid of the dispatch send kernel (signals disp_ready)
  int disp_recv_blocks;  // grid of the dispatch receive kernel (signals disp_consumed)
  int comb_send_blocks;  // grid of the combine send kernel (signals comb_ready)
  int comb_recv_blocks;  // grid of the combine receive kernel (signals comb_consumed)
  int disp_fmt;      // DispatchFormat
  int comb_fmt;      // CombineFormat
  unsigned int sign_mask;
  unsigned int buffer_tag;  // < 2^22, the same on every rank, one per Buffer: in each handle's dispatch epoch word
  long long max_recv_rows;
  int direct_self_min_tokens;  // smallest call that takes the direct self rows (NVFP4 without waves)

  // Dispatch staging row: [data | scales | meta], each section 16-byte aligned.
  long long disp_row_bytes;
  long long disp_data_bytes;   // payload element bytes (H/2, H or 2H)
  long long disp_scale_off;    // offset of the scale bytes in the row (NVFP4 H/16, MXFP8 H/32)
  long long disp_scale_bytes;  // 0 for BF16
  long long disp_meta_off;     // meta: f32 amax, i32 token, i32 idx[K], f32 w[K], i32 pos[K]
  // Combine row: S2F6 [codes H | scales H/32] or BF16 [2H].
  long long comb_row_bytes;
  long long comb_scale_off;

  // Offsets inside every rank's symmetric region.
  long long off_disp_ready;
  long long off_disp_consumed;
  long long off_comb_ready;
  long long off_comb_consumed;
  long long off_counts;
  long long count_stride;  // int32 words per source in the count area (>= num_local + 1)
  long long off_staging;
  long long off_combine;
  long long off_wave_index;
  long long off_disp_counts;  // disp_counts[W] (u64 counters)
  long long off_row_flags;    // row flags [W][T_max] (u32 epochs)
  long long off_abort;        // the abort word (u32, spin_wait.cuh): in the region, so that a peer can set it
  long long off_comb_desc;    // comb_desc[W] (u64 combine descriptors)

  unsigned long long timeout_ns;

  // Device addresses.
  const unsigned long long* peer_bases;  // [W] base of every rank's region (own rank: the local address)
  char* local_base;                      // my region
  NvlinkState* state;
  unsigned int* abort;    // local_base + off_abort: nonzero once this rank or a peer gave up (every wait then fails)
  int* scratch_pos;       // [T_max * K] position of (t, k) among this rank's rows for its expert
  int* scratch_slot;      // [T_max * K] staging slot at the destination rank (first slot of a rank) or -1
  int* expert_count;      // [E] rows this rank sends to each expert
  int* rank_count;        // [W] tokens this rank sends to each rank
  int* layout_base;       // [kLayoutMaxChunks][E + W] per token chunk: rows/tokens of earlier chunks per key
  unsigned long long* error_word;  // host-mapped: (1 << 63) | stage << 48 | peer << 32 | epoch
};

struct DispatchArgs {
  const void* x;          // bf16 [T, H]
  const void* topk_idx;   // int32 or int64 [T, K]
  int idx_is_int64;
  const float* topk_weights;  // [T, K]
  int num_tokens;
  int chunk_tokens;  // layout chunk (tokens per layout block); scratch_pos/slot are relative to the chunk
  // Handle (sender side copies, read by combine-receive).
  int* send_idx;    // [T, K] normalized expert ids (-1 masked)
  float* send_w;    // [T, K]
  unsigned long long* dispatch_epoch;  // [1] this dispatch's word (dispatch_word: epoch, Buffer tag): layout kernel
  // Expert-major result.
  unsigned char* out_data;    // NVFP4 [R, H/2] / MXFP8 [R, H] / BF16 [R, 2H bytes]
  unsigned char* out_scales;  // NVFP4 [R, H/16] / MXFP8 [R, H/32] / unused
  float* out_amax;            // NVFP4 [R] / unused
  int* num_per_expert;        // [E_local]
  int* expert_offsets;        // [E_local + 1]
  int* src_rank;              // [R]
  int* src_token;             // [R]
  int* topk_slot;             // [R]
  float* topk_weight;         // [R]
  float* row_weight;          // [R] the handle's own copy of topk_weight (what combine reads: edits of the result's
                              // topk_weight between dispatch and combine do not reach the combine)
  long long num_rows;         // R (capacity)
  // Handle (receiver side, read by combine-send).
  int* recv_count;  // [W] tokens received from each source
  int* recv_tok;    // [W * T_max] source token of staging row (s, j)
  int* recv_ord;    // [W * T_max] ordinal of this rank among the token's destination ranks
  int* recv_rows;   // [W * T_max * K] layout row of slot k of staging row (s, j), or -1
  // Waves (NVFP4 only; wave_values == nullptr: off). The receive also writes the grouped GEMM's operand rows
  // (grouped_gemm.py ExpandedRows: fp16 block values, the FP32 outer factor per row) in expert-major row order,
  // counting each expert's rows in wave.area as they land; wave_blocks blocks (<= disp_recv_blocks) receive, so
  // that the GEMM launched behind them (its PDL dependent) gets the other SMs.
  void* wave_values;       // fp16 [R, H]; wave_fp8: E4M3 [R, H] (one byte per value)
  float* wave_row_factor;  // [R]
  WaveSync wave;
  int wave_blocks;
  // Nonzero: the operand rows of the GEMM's inexact FP8 mode (grouped_gemm.py, expand_nvfp4_rows(precision=
  // "fp8_inexact")) instead of the exact fp16 ones: E4M3 of e2m1 * scale * 2^-3 in FP8_COLUMN_ORDER, row_factor * 8.
  // Needs H % 128 == 0 (the host launcher checks it).
  int wave_fp8;
  // Direct self rows (see the protocol above): set by the host launcher (bind_nvlink.cpp) for NVFP4 calls without
  // waves, without row_index (expand=False keeps every row in staging) and with at least cfg.direct_self_min_tokens
  // tokens; the send and the receive both read it from here.
  int direct_self;
  // Streaming receive (see the protocol above): set by the host launcher for dispatches without waves unless
  // EP_COMM_NVLINK_STREAM_RECV=0 (dispatch_stream_recv).
  int stream_recv;
  // The receive copies a row split across many warps (at most two 16-byte units per lane: small calls) with a short
  // loop instead of the unrolled one (copy_section): set by the host launcher unless EP_COMM_NVLINK_COMPACT_COPY=0
  // (dispatch_compact_copy).
  int compact_copy;
  // Self rows from x (streaming receive, BF16 and MXFP8): the send stores no staging rows for this rank itself; the
  // receive expands this rank's own tokens straight from x (MXFP8: quantized there, as the send would have), while the
  // peers' rows are still arriving.
  int self_from_x;
  // No expansion (Buffer.dispatch(expand=False)): the receive writes, for each expert-major row, the staging row that
  // holds its token (s * T_max + j; -1 for padding and unused rows) instead of copying the payload, and keeps the staging
  // rows (NvlinkState::held_epoch). The send then stages this rank's own rows too (no direct self rows, no self rows
  // from x). nullptr: the expert-major payload as usual.
  int* row_index;  // [R]
};

struct CombineArgs {
  const unsigned short* expert_out;  // bf16 [R, H]
  const float* row_weight;           // [R] (the handle's copy of DispatchResult.topk_weight)
  int local_reduce;
  const int* recv_count;
  const int* recv_tok;
  const int* recv_ord;
  const int* recv_rows;
  const int* send_idx;   // [T, K]
  const float* send_w;   // [T, K]
  const unsigned long long* dispatch_epoch;  // [1] the handle's dispatch word (DispatchArgs::dispatch_epoch)
  int num_tokens;
  unsigned short* out;   // bf16 [T, H]
  // The grouped GEMM's combine-row epilogue writes the local_reduce=False rows itself (another kernel). Before it,
  // the send kernel runs with wait_only (only the wait until every source has read the previous combine's rows from
  // its area); after it, the receive kernel runs with publish_rows (one thread first adds comb_send_blocks to each
  // peer's "ready" counter, what the send kernel's blocks would have added; kernel order on the stream makes the
  // GEMM's stores precede the release), then receives as usual.
  int wait_only;     // send kernel
  int publish_rows;  // receive kernel
};

// Host launchers (one per kernel family). `stream` is a cudaStream_t passed as an integer.
void launch_layout(const NvlinkConfig& cfg, const DispatchArgs& args, uintptr_t stream);
void launch_dispatch_send(const NvlinkConfig& cfg, const DispatchArgs& args, uintptr_t stream);
void launch_dispatch_recv(const NvlinkConfig& cfg, const DispatchArgs& args, uintptr_t stream);
void launch_combine_send(const NvlinkConfig& cfg, const CombineArgs& args, uintptr_t stream);
void launch_combine_recv(const NvlinkConfig& cfg, const CombineArgs& args, uintptr_t stream);
void launch_give_up(const NvlinkConfig& cfg, uintptr_t stream);  // set every peer's abort word (nvlink_give_up.cu)
bool dispatch_pdl_allowed();  // EP_COMM_NVLINK_PDL is not 0 (the streaming receive's launch)
bool dispatch_stream_recv();  // EP_COMM_NVLINK_STREAM_RECV: 1 (default) streaming receive, 0 wait for the whole send
bool dispatch_compact_copy();  // EP_COMM_NVLINK_COMPACT_COPY: 1 (default) short copy loop for split rows, 0 unrolled
// Shared-memory opt-ins that depend on the config (call once per Buffer, before any launch).
void prepare_layout_kernel(const NvlinkConfig& cfg);
void prepare_dispatch_kernels(const NvlinkConfig& cfg);
int layout_warps(const NvlinkConfig& cfg);
// Dynamic shared memory in bytes: one layout warp's histogram (E + W int32 counters, nvlink_layout.cu) and the
// dispatch kernels' receive layout (ReceiveLayout, nvlink_dispatch.cu).
size_t layout_warp_smem(int num_experts, int world);
size_t receive_layout_smem(int world, int num_local);

// Peer memory without NVSHMEM (peer_memory.cpp): CUDA IPC handles of a cudaMalloc'd region, and a small
// host-mapped word the kernels report errors into (readable by the host without a sync).
uintptr_t device_alloc_zeroed(int device, size_t bytes);
void device_free(int device, uintptr_t ptr);
void ipc_get_handle(int device, uintptr_t ptr, unsigned char out[64]);
uintptr_t ipc_open_handle(int device, const unsigned char handle[64]);
void ipc_close_handle(int device, uintptr_t ptr);
// What the kernels on `device` can do with memory of `peer` (cudaDeviceGetP2PAttribute, device -> peer): load and
// store at all, and native atomics -- the flags and counters (red.release.sys, atomicCAS_system) need them; a PCIe link
// often has access without them, NVLink has both. A device is its own peer.
struct PeerLink {
  bool access;
  bool native_atomics;
};
PeerLink peer_link(int device, int peer);
void host_mapped_alloc(int device, size_t bytes, uintptr_t* host_ptr, uintptr_t* device_ptr);
void host_mapped_free(uintptr_t host_ptr);

// Thread-block sizes.
constexpr int kCommThreads = 512;

#if defined(__CUDACC__)
// Host side of the kernel files: a failed CUDA call becomes a C++ exception (pybind11 turns it into a Python
// RuntimeError naming the step).
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    // Clear it as the thread's last error: a later launch checked with cudaGetLastError (the format kernels, give_up)
    // would otherwise report this failure as its own (a no-op for sticky errors, which every later call reports).
    cudaGetLastError();
    throw std::runtime_error(std::string("ep_comm nvlink: ") + what + ": " + cudaGetErrorString(err));
  }
}

// Raises, never lowers, `kernel`'s dynamic shared-memory limit on the current device to `bytes`. The limit belongs to
// the kernel function in the process, not to a Buffer: a later Buffer with smaller tables (fewer experts or ranks)
// must not cut it below what an earlier, larger Buffer's launches ask for (they would then fail, and a receive that
// cannot launch leaves its peers to time out). The mutex keeps two threads' read-then-raise from undoing each other.
inline void raise_dynamic_smem_limit(const void* kernel, size_t bytes, const char* what) {
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  cudaFuncAttributes attributes{};
  check_cuda(cudaFuncGetAttributes(&attributes, kernel), what);
  if (attributes.maxDynamicSharedSizeBytes >= 0 && static_cast<size_t>(attributes.maxDynamicSharedSizeBytes) >= bytes) {
    return;
  }
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), what);
}

// A warp's index in its grid, block-minor: consecutive indices fall on different blocks (SMs). The combine kernels
// hand out work items by this index, so a call with fewer items than warps spreads them over the SMs instead of
// filling the first blocks' schedulers while the other SMs idle: a 1-token combine (one item split into 14 column
// parts) took 9.2-9.4 us, against 10.8-11.0 in the same call (10.4-11.0 over that session's calls) at world 1 on H200
// (bench/RESULTS.md, thirty-third session). The dispatch kernels keep block-major items (blockIdx.x * warps + warp):
// block-minor measured 4.6-8.0% slower there for expand=False at 1 and 128 tokens, and -2.4% .. +1.8% for the
// expanding dispatch.
__device__ __forceinline__ int grid_warp_index() {
  return static_cast<int>(threadIdx.x / 32u * gridDim.x + blockIdx.x);
}

// ------------------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90): every nvlink kernel is launched with programmatic stream
// serialization, lets its dependent grid launch at once (launch_dependents) and waits for the full
// completion and memory flush of the preceding grid (griddepcontrol.wait) before its first instruction
// that touches memory. Stream semantics are therefore unchanged; only the launch latency of the next
// kernel is hidden behind the tail of the current one. The dependent grid is released only once every
// block of the primary has started, so waiting dependents never keep primary blocks from running.
// Which launches carry the attribute: dispatch_pdl / combine_pdl (nvlink_layout.cu; EP_COMM_NVLINK_PDL=1 all, 0 none,
// default the measured choice there). Without it, griddepcontrol.wait returns at once (the launch already waited for
// the preceding grid). launch_dependents acts whatever our own attribute: a following kernel launched WITH the
// attribute may start while ours still runs, which the PDL contract makes safe only if that kernel executes
// griddepcontrol.wait before it touches memory (ours all do; so do the grouped GEMM's wave launches).
__device__ __forceinline__ void pdl_prologue() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

bool dispatch_pdl(int num_tokens);  // the layout, send and receive kernels of a dispatch of num_tokens tokens
bool combine_pdl();                 // the combine's send and receive kernels

template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), int grid, int block, size_t smem, cudaStream_t stream,
                          bool pdl, Args... args) {
  return launch_with_pdl(kernel, static_cast<unsigned int>(grid), static_cast<unsigned int>(block), smem, stream, pdl,
                         args...);
}

// ------------------------------------------------------------------------------------------------------
// Memory-model helpers. Peers' writes land in our memory while kernels run: reads of such data use plain
// (coherent) loads after an acquire (ld_acquire_sys, spin_wait.cuh), never the non-coherent read-only path.
__device__ __forceinline__ void red_release_sys_add(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys_u32(unsigned int* p, unsigned int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int ld_relaxed_sys_u32(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned int ld_acquire_sys_u32(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint4 ld_coherent_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned int ld_coherent_u32(const void* p) {
  unsigned int v;
  asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned short ld_coherent_u16(const void* p) {
  unsigned short v;
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned char ld_coherent_u8(const void* p) {
  unsigned short v;
  asm volatile("ld.global.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return static_cast<unsigned char>(v);
}

// Read-only inputs written before the kernel started (x, expert_out): the non-coherent path is fine.
__device__ __forceinline__ uint4 ld_input_v4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ void st_v4(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Wait until *flag >= target. On a timeout record the stage and peer in the host-mapped error word (unless an error
// is already there), set the abort flag and return false; once the abort flag is set, return false at once (naming
// the peer that gave up, if one did: spin_wait.cuh). The kernel then runs on with whatever is in the buffer, so the
// process never hangs; the host raises at its next check.
__device__ __forceinline__ bool wait_counter(const NvlinkConfig& cfg, const unsigned long long* flag,
                                             unsigned long long target, int stage, int peer,
                                             unsigned long long epoch) {
  return spin_until([flag] { return ld_acquire_sys(flag); }, [target](unsigned long long v) { return v >= target; },
                    cfg.abort, cfg.error_word, cfg.timeout_ns,
                    [stage, peer, epoch] { return timeout_error_word(stage, peer, epoch); });
}

// A dispatch row's place in the [0, num_rows) result, or -1 when it falls outside: the rows it would write are not
// written (they would land in other tensors) and the fault is recorded like a timeout (abort flag, error word naming the
// stage and the source rank), so the host raises at its next check. Never taken when every rank's counts and rows
// belong to the same call and the ids are valid; it bounds the damage when they are not.
__device__ __forceinline__ int row_in_capacity(const NvlinkConfig& cfg, long long row, long long num_rows, int source) {
  if (row >= 0 && row < num_rows) return static_cast<int>(row);
  record_fault(cfg.abort, cfg.error_word, timeout_error_word(kStageRowPastCapacity, source, cfg.state->disp_epoch));
  return -1;
}

// Whether this Buffer gave up (a wait timed out, a fault was recorded, or a peer said it gave up): from then on it is
// fail-stop towards its peers (block_wait_all_peers, signal_all_peers_once, the combine-row GEMM epilogue).
__device__ __forceinline__ bool aborted(const NvlinkConfig& cfg) {
  return *reinterpret_cast<const volatile unsigned int*>(cfg.abort) != 0u;
}

// Every block: thread p < W waits on counter p of `flags` (in my region), then the block proceeds. Returns, the same
// for every thread of the block, whether it may go on storing into its peers: false when a wait failed or the Buffer
// had given up (fail-stop; senders then return at once). The abort check matters even when every flag is in: after
// a dispatch receive timed out, the next combine's inputs are invalid although the peers have read the previous
// combine, and a slow peer would take them as its own. The abort word is read before the waits, so that its latency
// overlaps theirs (measured within the run-to-run spread at world 1, bench/RESULTS.md, twenty-sixth session).
__device__ __forceinline__ bool block_wait_all_peers(const NvlinkConfig& cfg, long long flags_off,
                                                     unsigned long long target, int stage,
                                                     unsigned long long epoch) {
  const unsigned long long* flags = reinterpret_cast<const unsigned long long*>(cfg.local_base + flags_off);
  const bool gave_up = threadIdx.x == 0 && aborted(cfg);
  bool ok = true;
  for (int p = threadIdx.x; p < cfg.world; p += blockDim.x) {
    ok = wait_counter(cfg, flags + p, target, stage, p, epoch) && ok;
  }
  return !__syncthreads_or(!ok || gave_up);
}

// A call's epoch from thread 0's start ticket (NvlinkState::comb_*_tickets, disp_recv_tickets): every call launches the
// kernel once and its blocks take `grid_share` tickets in all, so ticket / grid_share counts the earlier calls. Whole block (one
// barrier). Kernels take the ticket before griddepcontrol.launch_dependents: the next call's kernel may then start
// early (programmatic launches down the stream), but draws only after every block of this call has drawn.
__device__ __forceinline__ unsigned long long block_epoch_from_ticket(unsigned long long ticket,
                                                                      unsigned long long grid_share) {
  __shared__ unsigned long long epoch;
  if (threadIdx.x == 0) epoch = ticket / grid_share + 1ull;
  __syncthreads();
  return epoch;
}

// Add `amount` to counter `my rank` of `flags` in peer p's region with release semantics at system scope. Callers
// signal for the whole block after a __syncthreads: the release is cumulative over the stores the barrier ordered
// before it (those of every thread of the block), so no separate fence is needed. A fence.sc.sys before each
// release (the earlier form) cost ~1-1.5 us per small dispatch or combine on 2xH200 (bench/RESULTS.md, twelfth
// session). Stores of an earlier kernel take signal_all_peers_once, which fences first.
__device__ __forceinline__ void signal_peer(const NvlinkConfig& cfg, long long flags_off, int p,
                                            unsigned long long amount) {
  unsigned long long* flag =
      reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(cfg.peer_bases[p]) + flags_off) + cfg.rank;
  red_release_sys_add(flag, amount);
}

// Every block, after its last access: add 1 to counter `my rank` of `flags` in every peer's region. No abort check
// here (it would put a load before every kernel's last signal, ~1 us per small call): fail-stop holds without it,
// since a sender that gave up returned at its block_wait_all_peers and so never gets here, and a "consumed" signal
// after giving up only lets the peer send rows this rank will never answer, so that the peer times out.
__device__ __forceinline__ void block_signal_all_peers(const NvlinkConfig& cfg, long long flags_off) {
  __syncthreads();
  for (int p = threadIdx.x; p < cfg.world; p += blockDim.x) signal_peer(cfg, flags_off, p, 1ull);
}

// One thread publishes for a whole grid: add `amount` to counter `my rank` of `flags` in every peer's region --
// unless this Buffer gave up: for the combine-row form this publishes the GEMM's rows, which it did not store after an
// abort, so the peer must time out instead of reading them (the held-epoch consumed signal is skipped too, harmlessly).
__device__ __forceinline__ void signal_all_peers_once(const NvlinkConfig& cfg, long long flags_off,
                                                      unsigned long long amount) {
  const bool stop = aborted(cfg);  // read once, overlapping the fence
  __threadfence_system();  // the rows it publishes were stored by an earlier kernel
  if (stop) return;
  for (int p = 0; p < cfg.world; ++p) signal_peer(cfg, flags_off, p, amount);
}

// The handle's dispatch word (DispatchArgs::dispatch_epoch): the dispatch's epoch in bits 0..39 and the dispatching
// Buffer's tag (NvlinkConfig::buffer_tag) in bits 40..61, so that a handle of another Buffer with the same call count
// differs too. 2^40 dispatches per Buffer before the epoch part wraps.
__device__ __forceinline__ unsigned long long dispatch_word(unsigned long long epoch, unsigned int buffer_tag) {
  return (epoch & ((1ull << kDispatchEpochBits) - 1ull)) |
         (static_cast<unsigned long long>(buffer_tag) << kDispatchEpochBits);
}

// What a combine's rows belong to (comb_desc): the dispatch word of the handle it combines (dispatch epoch and
// Buffer tag) and its local_reduce mode (the row layout); bit 63 set, so that no descriptor is the region's initial
// zero.
__device__ __forceinline__ unsigned long long combine_descriptor(unsigned long long dispatch_epoch, int local_reduce) {
  return (1ull << 63) | ((dispatch_epoch & 0x3FFFFFFFFFFFFFFFull) << 1) | (local_reduce ? 1ull : 0ull);
}

__device__ __forceinline__ char* peer_ptr(const NvlinkConfig& cfg, int peer, long long offset) {
  return reinterpret_cast<char*>(static_cast<uintptr_t>(cfg.peer_bases[peer])) + offset;
}

// Warps sharing one work item (a token row) when there are fewer items than warps: each of the G warps
// takes every G-th group of 32 units of the row (small calls are latency-bound, not bandwidth-bound).
__device__ __forceinline__ int split_factor(long long items, int num_warps, int max_split) {
  if (items <= 0) return 1;
  long long g = num_warps / items;
  if (g > max_split) g = max_split;
  return g < 1 ? 1 : static_cast<int>(g);
}

// Ordinal of rank `me` among the distinct destination ranks of a token, and the number of distinct ranks,
// from lane k's slot rank r (lanes k >= K pass -1). Whole warp must call.
__device__ __forceinline__ void distinct_rank_info(int r, int topk, int lane, int me, int* ordinal, int* count) {
  bool first = r >= 0;
  for (int k = 0; k < topk; ++k) {
    const int other = __shfl_sync(0xFFFFFFFFu, r, k);
    if (k < lane && other == r) first = false;
  }
  const unsigned int firsts = __ballot_sync(0xFFFFFFFFu, first);
  const unsigned int below = __ballot_sync(0xFFFFFFFFu, first && r < me);
  *ordinal = __popc(below);
  *count = __popc(firsts);
}
#endif  // __CUDACC__

}  // namespace nvlink
}  // namespace ep_comm
