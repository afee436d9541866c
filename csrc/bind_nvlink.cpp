// Python bindings of the NVLink backend (register_nvlink, called by bindings.cpp). Torch-free: every
// tensor arrives as a device address (int), the stream as an int.
//
//   ctx = _C.NvlinkContext(device, config_dict)      # config_dict: the NvlinkConfig fields by name
//   ctx.dispatch(...addresses..., stream)            # layout + quantize/send + receive/expand
//   ctx.combine(...addresses..., stream)             # reduce/RHT/S2F6/send + receive/accumulate
//   _C.nvlink_ipc_* / _C.nvlink_host_mapped_*        # CUDA IPC fallback and the error word
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <iterator>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "nvlink.h"

namespace py = pybind11;
using namespace ep_comm::nvlink;

namespace {

template <typename T>
T get(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("NvlinkContext config misses '") + key + "'");
  return d[key].cast<T>();
}

using ep_comm::binding::ptr;

// The combine formats this build has kernels for (nvlink.h CombineFormat): what NvlinkContext accepts, and what
// nvlink.py reads as nvlink_combine_format_codes (an extension built before a format existed would otherwise run
// another format's kernels on its rows).
constexpr int kCombineFormatCodes[] = {kCombS2f6, kCombBf16, kCombMxfp8};

bool known_combine_format(int code) {
  for (int known : kCombineFormatCodes) {
    if (code == known) return true;
  }
  return false;
}

class NvlinkContext {
 public:
  NvlinkContext(int device, const py::dict& d) : device_(device) {
    NvlinkConfig& c = cfg_;
    c.rank = get<int>(d, "rank");
    c.world = get<int>(d, "world");
    c.hidden = get<int>(d, "hidden");
    c.num_experts = get<int>(d, "num_experts");
    c.num_local = get<int>(d, "num_local");
    c.topk = get<int>(d, "topk");
    c.max_tokens = get<int>(d, "max_tokens");
    c.alignment = get<int>(d, "alignment");
    c.disp_send_blocks = get<int>(d, "disp_send_blocks");
    c.disp_recv_blocks = get<int>(d, "disp_recv_blocks");
    c.comb_send_blocks = get<int>(d, "comb_send_blocks");
    c.comb_recv_blocks = get<int>(d, "comb_recv_blocks");
    c.disp_fmt = get<int>(d, "disp_fmt");
    c.comb_fmt = get<int>(d, "comb_fmt");
    c.sign_mask = get<unsigned int>(d, "sign_mask");
    c.buffer_tag = get<unsigned int>(d, "buffer_tag");
    c.max_recv_rows = get<long long>(d, "max_recv_rows");
    c.disp_row_bytes = get<long long>(d, "disp_row_bytes");
    c.disp_data_bytes = get<long long>(d, "disp_data_bytes");
    c.disp_scale_off = get<long long>(d, "disp_scale_off");
    c.disp_scale_bytes = get<long long>(d, "disp_scale_bytes");
    c.disp_meta_off = get<long long>(d, "disp_meta_off");
    c.comb_row_bytes = get<long long>(d, "comb_row_bytes");
    c.comb_scale_off = get<long long>(d, "comb_scale_off");
    c.off_disp_ready = get<long long>(d, "off_disp_ready");
    c.off_disp_consumed = get<long long>(d, "off_disp_consumed");
    c.off_comb_ready = get<long long>(d, "off_comb_ready");
    c.off_comb_consumed = get<long long>(d, "off_comb_consumed");
    c.off_counts = get<long long>(d, "off_counts");
    c.count_stride = get<long long>(d, "count_stride");
    c.off_staging = get<long long>(d, "off_staging");
    c.off_combine = get<long long>(d, "off_combine");
    c.off_wave_index = get<long long>(d, "off_wave_index");
    c.off_disp_counts = get<long long>(d, "off_disp_counts");
    c.off_row_flags = get<long long>(d, "off_row_flags");
    c.off_abort = get<long long>(d, "off_abort");
    c.off_comb_desc = get<long long>(d, "off_comb_desc");
    c.direct_self_min_tokens = get<int>(d, "direct_self_min_tokens");
    c.timeout_ns = get<unsigned long long>(d, "timeout_ns");
    c.peer_bases = ptr<const unsigned long long>(get<uintptr_t>(d, "peer_bases"));
    c.local_base = ptr<char>(get<uintptr_t>(d, "local_base"));
    c.state = ptr<NvlinkState>(get<uintptr_t>(d, "state"));
    c.scratch_pos = ptr<int>(get<uintptr_t>(d, "scratch_pos"));
    c.scratch_slot = ptr<int>(get<uintptr_t>(d, "scratch_slot"));
    c.expert_count = ptr<int>(get<uintptr_t>(d, "expert_count"));
    c.rank_count = ptr<int>(get<uintptr_t>(d, "rank_count"));
    c.layout_base = ptr<int>(get<uintptr_t>(d, "layout_base"));
    c.error_word = ptr<unsigned long long>(get<uintptr_t>(d, "error_word"));
    if (c.topk < 1 || c.topk > kMaxTopk) throw std::invalid_argument("num_topk must be in [1, 32] for nvlink");
    if (c.world < 1 || c.world > kMaxWorld) throw std::invalid_argument("world size out of range for nvlink");
    // The Python backend derives all of this from a validated BufferConfig; checked here too because a wrong rank or
    // size would make the kernels store outside the region (into the peers' memory too), not fail.
    if (c.rank < 0 || c.rank >= c.world) throw std::invalid_argument("rank must be in [0, world)");
    if (c.hidden <= 0 || c.hidden % 32 != 0) throw std::invalid_argument("hidden must be a positive multiple of 32");
    // (the kernels' per-row element offsets and the layout's token sums are 32-bit: nvlink.py's _MAX_HIDDEN and
    // _MAX_TOKENS, repeated for a direct caller)
    if (c.hidden > (1 << 20)) throw std::invalid_argument("hidden must be <= 2^20 for nvlink");
    if (c.max_tokens > (1 << 30)) throw std::invalid_argument("max_tokens must be <= 2^30 for nvlink");
    if (c.num_local < 1 || static_cast<long long>(c.num_local) * c.world != c.num_experts) {
      throw std::invalid_argument("num_experts must be num_local * world with num_local >= 1");
    }
    if (c.max_tokens < 0 || c.max_recv_rows < 0) throw std::invalid_argument("max_tokens and max_recv_rows must be >= 0");
    if (c.peer_bases == nullptr || c.local_base == nullptr || c.state == nullptr || c.error_word == nullptr) {
      throw std::invalid_argument("peer_bases, local_base, state and error_word must be device addresses, not 0");
    }
    if (c.buffer_tag >= (1u << kBufferTagBits)) throw std::invalid_argument("buffer_tag must be below 2^22");
    if (c.off_abort < 0 || c.off_abort % 4 != 0) throw std::invalid_argument("off_abort must be a 4-byte aligned offset");
    c.abort = reinterpret_cast<unsigned int*>(c.local_base + c.off_abort);
    if (c.off_comb_desc < 0 || c.off_comb_desc % 8 != 0) {
      throw std::invalid_argument("off_comb_desc must be an 8-byte aligned offset");
    }
    if (c.disp_send_blocks < 1 || c.disp_recv_blocks < 1 || c.comb_send_blocks < 1 || c.comb_recv_blocks < 1)
      throw std::invalid_argument("nvlink kernel block counts must be >= 1");
    // The launchers pick kernels by these codes; an unknown one would run a kernel of another row size.
    if (c.disp_fmt != kDispNvfp4 && c.disp_fmt != kDispMxfp8 && c.disp_fmt != kDispBf16)
      throw std::invalid_argument("unknown dispatch format code " + std::to_string(c.disp_fmt));
    if (!known_combine_format(c.comb_fmt))
      throw std::invalid_argument("unknown combine format code " + std::to_string(c.comb_fmt));
    select();
    prepare_layout_kernel(c);
    prepare_dispatch_kernels(c);
  }

  void launch_dispatch(DispatchArgs a, uintptr_t stream) {
    select();
    // Direct self rows (nvlink.h): NVFP4, whose send runs on every SM, stores this rank's own rows expanded while it
    // quantizes, so the receive expands only the other ranks' rows. A wave receive reads every source's staging rows,
    // so waves keep them; tiny calls skip the extra wait for the counts (Python sets the threshold).
    a.direct_self = cfg_.disp_fmt == kDispNvfp4 && a.wave_values == nullptr && a.row_index == nullptr &&
                    a.num_tokens >= cfg_.direct_self_min_tokens;
    // Streaming receive (nvlink.h): the receive expands rows as they arrive. A wave receive keeps the wait for the
    // whole send (it writes rows expert by expert, in an order unrelated to the send's).
    a.stream_recv = a.wave_values == nullptr && dispatch_stream_recv() ? 1 : 0;
    a.compact_copy = dispatch_compact_copy() ? 1 : 0;
    // Self rows from x (nvlink.h), BF16 and MXFP8: the send stores no staging rows for this rank itself, and the receive
    // makes those rows from x (BF16 copied, MXFP8 quantized) while the peers' rows are still arriving.
    // Neither with row_index (no expansion): every row the result names must be in staging, this rank's own too.
    a.self_from_x = a.stream_recv && a.row_index == nullptr && (cfg_.disp_fmt == kDispBf16 || cfg_.disp_fmt == kDispMxfp8)
                        ? 1 : 0;
    launch_layout(cfg_, a, stream);
    launch_dispatch_send(cfg_, a, stream);
    launch_dispatch_recv(cfg_, a, stream);
  }

  // The receive side's fields (this rank's own routing and the output).
  CombineArgs receive_args(uintptr_t send_idx, uintptr_t send_w, uintptr_t dispatch_epoch, int num_tokens,
                           uintptr_t out) const {
    if (num_tokens < 0 || num_tokens > cfg_.max_tokens) throw std::invalid_argument("num_tokens out of range");
    if (!dispatch_epoch) throw std::invalid_argument("combine needs the handle's dispatch epoch");
    CombineArgs a{};
    a.send_idx = ptr<const int>(send_idx);
    a.send_w = ptr<const float>(send_w);
    a.dispatch_epoch = ptr<const unsigned long long>(dispatch_epoch);
    a.num_tokens = num_tokens;
    a.out = ptr<unsigned short>(out);
    return a;
  }

  void combine(uintptr_t expert_out, uintptr_t row_weight, bool local_reduce, uintptr_t recv_count,
               uintptr_t recv_tok, uintptr_t recv_ord, uintptr_t recv_rows, uintptr_t send_idx, uintptr_t send_w,
               uintptr_t dispatch_epoch, int num_tokens, uintptr_t out, uintptr_t stream) {
    CombineArgs a = receive_args(send_idx, send_w, dispatch_epoch, num_tokens, out);
    a.expert_out = ptr<const unsigned short>(expert_out);
    a.row_weight = ptr<const float>(row_weight);
    a.local_reduce = local_reduce ? 1 : 0;
    a.recv_count = ptr<const int>(recv_count);
    a.recv_tok = ptr<const int>(recv_tok);
    a.recv_ord = ptr<const int>(recv_ord);
    a.recv_rows = ptr<const int>(recv_rows);
    select();
    launch_combine_send(cfg_, a, stream);
    launch_combine_recv(cfg_, a, stream);
  }

  // The combine of rows that the grouped GEMM's combine-row epilogue stores itself (local_reduce=False rows):
  // begin before the GEMM (wait until the sources have read the previous combine), finish after it (the receive
  // kernel publishes, then receives: weights applied and summed in top-k slot order, inverse RHT, bf16 out).
  void combine_rows_begin(uintptr_t dispatch_epoch, uintptr_t stream) {
    if (!dispatch_epoch) throw std::invalid_argument("combine needs the handle's dispatch epoch");
    CombineArgs a{};
    a.wait_only = 1;
    a.dispatch_epoch = ptr<const unsigned long long>(dispatch_epoch);  // rows of the local_reduce=False form
    select();
    launch_combine_send(cfg_, a, stream);
  }

  void combine_rows_finish(uintptr_t send_idx, uintptr_t send_w, uintptr_t dispatch_epoch, int num_tokens,
                           uintptr_t out, uintptr_t stream) {
    CombineArgs a = receive_args(send_idx, send_w, dispatch_epoch, num_tokens, out);
    a.local_reduce = 0;
    a.publish_rows = 1;  // the receive kernel releases the GEMM's rows itself: one launch instead of two
    select();
    launch_combine_recv(cfg_, a, stream);
  }

  // One-allocation dispatch outputs: every result/handle tensor is a 256-byte aligned section of one
  // uint8 arena (Python carves the views from the same table). Order and sizes are fixed by the config
  // and num_tokens; absent sections (scales for BF16, amax unless NVFP4) have 0 bytes.
  static constexpr int kArenaSections = 18;
  struct ArenaLayout {
    long long off[kArenaSections];
    long long bytes[kArenaSections];
    long long total;
  };
  // rows: the table of a dispatch without expansion (row_index): no payload or scale section, a row_index section.
  // The sections every call has (0, 1, 4..14, 16) sit at the same offsets either way (2 and 3 come last, 15 after
  // 16), so combine reads either kind of arena with the expanded table.
  ArenaLayout arena_layout(int num_tokens, bool rows = false) const {
    const NvlinkConfig& c = cfg_;
    const long long T = num_tokens, K = c.topk, R = c.max_recv_rows, W = c.world, L = c.num_local;
    const long long tmax = c.max_tokens;
    const long long sizes[kArenaSections] = {
        4 * T * K,                                   // 0 send_idx i32 [T, K]
        4 * T * K,                                   // 1 send_w f32 [T, K]
        rows ? 0 : R * c.disp_data_bytes,            // 2 data [R, payload bytes]
        rows ? 0 : R * c.disp_scale_bytes,           // 3 scales [R, scale bytes]
        c.disp_fmt == kDispNvfp4 ? 4 * R : 0,        // 4 amax f32 [R]
        4 * L,                                       // 5 num_per_expert i32 [L]
        4 * (L + 1),                                 // 6 expert_offsets i32 [L + 1]
        4 * R,                                       // 7 src_rank i32 [R]
        4 * R,                                       // 8 src_token i32 [R]
        4 * R,                                       // 9 topk_slot i32 [R]
        4 * R,                                       // 10 topk_weight f32 [R]
        4 * W,                                       // 11 recv_count i32 [W]
        4 * W * tmax,                                // 12 recv_tok i32 [W * T_max]
        4 * W * tmax,                                // 13 recv_ord i32 [W * T_max]
        4 * W * tmax * K,                            // 14 recv_rows i32 [W * T_max * K]
        rows ? 4 * R : 0,                            // 15 row_index i32 [R] (rows only)
        8,                                           // 16 dispatch word u64 [1]: epoch and Buffer tag (layout kernel)
        4 * R,                                       // 17 row_weight f32 [R]: the handle's copy of topk_weight
    };
    // Physical order: the 4- and 8-byte-element sections first (Python views them as one int32 block), then the
    // payload and scale bytes.
    static constexpr int kOrder[kArenaSections] = {0, 1, 4, 5, 6, 7, 8, 9, 10, 17, 11, 12, 13, 14, 16, 15, 2, 3};
    ArenaLayout a{};
    long long run = 0;
    for (int o = 0; o < kArenaSections; ++o) {
      const int i = kOrder[o];
      a.off[i] = run;
      a.bytes[i] = sizes[i];
      run += (sizes[i] + 255) / 256 * 256;
    }
    a.total = run > 0 ? run : 256;
    return a;
  }

  py::tuple dispatch_arena_layout(int num_tokens, bool rows) const {
    if (num_tokens < 0 || num_tokens > cfg_.max_tokens) throw std::invalid_argument("num_tokens out of range");
    const ArenaLayout a = arena_layout(num_tokens, rows);
    py::list offs, sizes;
    for (int i = 0; i < kArenaSections; ++i) {
      offs.append(a.off[i]);
      sizes.append(a.bytes[i]);
    }
    return py::make_tuple(offs, sizes, a.total);
  }

  // The dispatch, with every output address derived from one arena base (the host path of a call is one
  // pybind call with 7 integers; the layout is recomputed here, a few dozen integer operations).
  void dispatch_arena(uintptr_t x, uintptr_t topk_idx, bool idx_is_int64, uintptr_t topk_weights, int num_tokens,
                      uintptr_t arena, uintptr_t stream) {
    launch_dispatch(arena_args(x, topk_idx, idx_is_int64, topk_weights, num_tokens, arena), stream);
  }

  // dispatch_arena without expansion: the arena has the rows table (dispatch_arena_layout(num_tokens, true)), the
  // receive writes row_index (section 15) and leaves the rows in staging until the next dispatch.
  void dispatch_arena_rows(uintptr_t x, uintptr_t topk_idx, bool idx_is_int64, uintptr_t topk_weights, int num_tokens,
                           uintptr_t arena, uintptr_t stream) {
    DispatchArgs a = arena_args(x, topk_idx, idx_is_int64, topk_weights, num_tokens, arena, true);
    a.row_index = ptr<int>(arena + static_cast<uintptr_t>(arena_layout(num_tokens, true).off[15]));
    launch_dispatch(a, stream);
  }

  // The dispatch's arguments with every output address at its arena section (sections 0..14, 16 and 17, in the order of
  // arena_layout; an empty section gives a null address).
  DispatchArgs arena_args(uintptr_t x, uintptr_t topk_idx, bool idx_is_int64, uintptr_t topk_weights, int num_tokens,
                          uintptr_t arena, bool rows = false) const {
    if (num_tokens < 0 || num_tokens > cfg_.max_tokens) throw std::invalid_argument("num_tokens out of range");
    const ArenaLayout l = arena_layout(num_tokens, rows);
    auto at = [&](int i) -> uintptr_t { return l.bytes[i] > 0 ? arena + static_cast<uintptr_t>(l.off[i]) : 0; };
    DispatchArgs a{};
    a.x = ptr<const void>(x);
    a.topk_idx = ptr<const void>(topk_idx);
    a.idx_is_int64 = idx_is_int64 ? 1 : 0;
    a.topk_weights = ptr<const float>(topk_weights);
    a.num_tokens = num_tokens;
    a.chunk_tokens = layout_chunk_tokens(num_tokens);
    a.send_idx = ptr<int>(at(0));
    a.send_w = ptr<float>(at(1));
    a.out_data = ptr<unsigned char>(at(2));
    a.out_scales = ptr<unsigned char>(at(3));
    a.out_amax = ptr<float>(at(4));
    a.num_per_expert = ptr<int>(at(5));
    a.expert_offsets = ptr<int>(at(6));
    a.src_rank = ptr<int>(at(7));
    a.src_token = ptr<int>(at(8));
    a.topk_slot = ptr<int>(at(9));
    a.topk_weight = ptr<float>(at(10));
    a.row_weight = ptr<float>(at(17));
    a.num_rows = cfg_.max_recv_rows;
    a.recv_count = ptr<int>(at(11));
    a.recv_tok = ptr<int>(at(12));
    a.recv_ord = ptr<int>(at(13));
    a.recv_rows = ptr<int>(at(14));
    a.dispatch_epoch = ptr<unsigned long long>(at(16));
    return a;
  }

  // dispatch_arena whose receive also writes the grouped GEMM's operand rows expert by expert on wave_blocks blocks
  // and counts them in the wave sync area (waves.h): the w1 GEMM launched next, with the same area, starts on the
  // SMs this receive leaves free as soon as its experts' rows are in. NVFP4 only. fp8: the operand rows of the GEMM's
  // inexact FP8 mode (wave_values E4M3 [R, H], H % 128 == 0; DispatchArgs::wave_fp8) instead of the exact fp16 ones.
  void dispatch_arena_waves(uintptr_t x, uintptr_t topk_idx, bool idx_is_int64, uintptr_t topk_weights,
                            int num_tokens, uintptr_t arena, uintptr_t wave_values, uintptr_t wave_row_factor,
                            uintptr_t wave_area, int wave_blocks, uintptr_t stream, bool fp8) {
    if (cfg_.disp_fmt != kDispNvfp4) throw std::invalid_argument("waves need the NVFP4 dispatch format");
    if (wave_blocks < 1 || wave_blocks > cfg_.disp_recv_blocks) {
      throw std::invalid_argument("wave_blocks must be in [1, the receive's block count]");
    }
    if (!wave_values || !wave_row_factor || !wave_area) throw std::invalid_argument("waves need their three buffers");
    // The FP8 rows are written 8 bytes per lane, a 16-column block per lane pair (wave_fp8_half_block).
    if (fp8 && (cfg_.hidden % 128 != 0 || wave_values % 8 != 0)) {
      throw std::invalid_argument("FP8 waves need hidden % 128 == 0 and 8-byte aligned values");
    }
    DispatchArgs a = arena_args(x, topk_idx, idx_is_int64, topk_weights, num_tokens, arena);
    a.wave_values = ptr<void>(wave_values);
    a.wave_fp8 = fp8 ? 1 : 0;
    a.wave_row_factor = ptr<float>(wave_row_factor);
    a.wave.area = ptr<unsigned long long>(wave_area);
    a.wave_blocks = wave_blocks;
    launch_dispatch(a, stream);
  }

  // Set every peer's abort word (nvlink_give_up.cu): this rank's call raised before launching, so the peers stop
  // waiting for it now instead of at their timeout.
  void give_up(uintptr_t stream) {
    select();
    launch_give_up(cfg_, stream);
  }

  // What the w1 GEMM of a wave dispatch needs besides the sync area: (address of the dispatch epoch, of the abort
  // flag, of the host-mapped error word, timeout in ns).
  py::tuple wave_sync() const {
    return py::make_tuple(reinterpret_cast<uintptr_t>(&cfg_.state->disp_epoch),
                          reinterpret_cast<uintptr_t>(cfg_.abort), reinterpret_cast<uintptr_t>(cfg_.error_word),
                          cfg_.timeout_ns);
  }

  // combine() reading the handle from a dispatch arena (same table as dispatch_arena).
  void combine_arena(uintptr_t expert_out, uintptr_t arena, int num_tokens, bool local_reduce, uintptr_t out,
                     uintptr_t stream) {
    if (num_tokens < 0 || num_tokens > cfg_.max_tokens) throw std::invalid_argument("num_tokens out of range");
    const ArenaLayout l = arena_layout(num_tokens);
    auto at = [&](int i) -> uintptr_t { return arena + static_cast<uintptr_t>(l.off[i]); };
    combine(expert_out, at(17), local_reduce, at(11), at(12), at(13), at(14), at(0), at(1), at(16), num_tokens, out,
            stream);
  }

  int layout_threads() const { return layout_warps(cfg_) * 32; }
  int comm_threads() const { return kCommThreads; }

 private:
  void select() const { ep_comm::binding::check(cudaSetDevice(device_), "cudaSetDevice", "device ordinal"); }

  int device_;
  NvlinkConfig cfg_{};
};

}  // namespace

void register_nvlink(py::module_& m) {
  py::class_<NvlinkContext>(m, "NvlinkContext",
                            "Static NVLink dispatch/combine state of one Buffer (addresses owned by Python)")
      .def(py::init<int, const py::dict&>(), py::arg("device"), py::arg("config"))
      .def("combine", &NvlinkContext::combine)
      .def("dispatch_arena_layout", &NvlinkContext::dispatch_arena_layout)
      .def("dispatch_arena", &NvlinkContext::dispatch_arena)
      .def("dispatch_arena_rows", &NvlinkContext::dispatch_arena_rows)
      .def("dispatch_arena_waves", &NvlinkContext::dispatch_arena_waves, py::arg("x"), py::arg("topk_idx"),
           py::arg("idx_is_int64"), py::arg("topk_weights"), py::arg("num_tokens"), py::arg("arena"),
           py::arg("wave_values"), py::arg("wave_row_factor"), py::arg("wave_area"), py::arg("wave_blocks"),
           py::arg("stream"), py::arg("fp8") = false)
      .def("wave_sync", &NvlinkContext::wave_sync)
      .def("combine_arena", &NvlinkContext::combine_arena)
      .def("combine_rows_begin", &NvlinkContext::combine_rows_begin)
      .def("combine_rows_finish", &NvlinkContext::combine_rows_finish)
      .def("give_up", &NvlinkContext::give_up)
      .def_property_readonly("layout_threads", &NvlinkContext::layout_threads)
      .def_property_readonly("comm_threads", &NvlinkContext::comm_threads);
  m.attr("nvlink_state_bytes") = py::int_(sizeof(NvlinkState));
  m.attr("wave_area_fixed_words") = py::int_(ep_comm::kWaveRowsDone);  // + one word per local expert
  m.attr("nvlink_max_topk") = py::int_(kMaxTopk);
  m.attr("nvlink_buffer_tag_bits") = py::int_(kBufferTagBits);
  m.attr("nvlink_dispatch_epoch_bits") = py::int_(kDispatchEpochBits);
  m.attr("nvlink_max_world") = py::int_(kMaxWorld);
  m.attr("nvlink_layout_max_chunks") = py::int_(kLayoutMaxChunks);
  py::tuple combine_codes(std::size(kCombineFormatCodes));
  for (std::size_t i = 0; i < std::size(kCombineFormatCodes); ++i) combine_codes[i] = py::int_(kCombineFormatCodes[i]);
  m.attr("nvlink_combine_format_codes") = combine_codes;  // (kCombineFormatCodes)
  // What ep_comm/backends/nvlink.py _check_nvlink_limits tests a configuration against (nvlink.h).
  m.attr("nvlink_max_dynamic_smem") = py::int_(kMaxDynamicSmem);
  m.def("nvlink_layout_warp_smem", &layout_warp_smem, py::arg("num_experts"), py::arg("world"),
        "bytes of dynamic shared memory one warp of the layout kernel takes (E + W int32 counters)");
  m.def("nvlink_receive_layout_smem", &receive_layout_smem, py::arg("world"), py::arg("num_local"),
        "bytes of dynamic shared memory the dispatch kernels' receive layout takes");

  // The peer-memory calls can block on the whole device (cudaDeviceSynchronize, cudaFree): without the GIL, so that
  // other Python threads (a watchdog, a data loader) run meanwhile. They touch no Python object.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("nvlink_device_alloc", &device_alloc_zeroed, py::arg("device"), py::arg("bytes"), no_gil,
        "cudaMalloc + zero fill (CUDA IPC fallback region); returns the address");
  m.def("nvlink_device_free", &device_free, py::arg("device"), py::arg("ptr"), no_gil);
  m.def(
      "nvlink_ipc_get_handle",
      [](int device, uintptr_t ptr) {
        unsigned char handle[64];
        {
          py::gil_scoped_release no_gil_here;
          ipc_get_handle(device, ptr, handle);
        }
        return py::bytes(reinterpret_cast<const char*>(handle), 64);
      },
      py::arg("device"), py::arg("ptr"), "64-byte cudaIpcMemHandle_t of a cudaMalloc'd address");
  m.def(
      "nvlink_ipc_open_handle",
      [](int device, py::bytes handle) {
        const std::string raw = handle;
        if (raw.size() != 64) throw std::invalid_argument("a CUDA IPC handle has 64 bytes");
        py::gil_scoped_release no_gil_here;  // the bytes are copied into `raw` above
        return ipc_open_handle(device, reinterpret_cast<const unsigned char*>(raw.data()));
      },
      py::arg("device"), py::arg("handle"), "map a peer's region; returns the local address of it");
  m.def("nvlink_ipc_close_handle", &ipc_close_handle, py::arg("device"), py::arg("ptr"), no_gil);
  m.def(
      "nvlink_peer_link",
      [](int device, int peer) {
        const PeerLink link = peer_link(device, peer);
        return py::make_tuple(link.access, link.native_atomics);
      },
      py::arg("device"), py::arg("peer"), "(access, native_atomics) from device's kernels to peer's memory");
  m.def(
      "nvlink_host_mapped_alloc",
      [](int device, size_t bytes) {
        uintptr_t host = 0, dev = 0;
        {
          py::gil_scoped_release no_gil_here;
          host_mapped_alloc(device, bytes, &host, &dev);
        }
        return py::make_tuple(host, dev);
      },
      py::arg("device"), py::arg("bytes"), "zeroed pinned host memory mapped into the device: (host address, device address)");
  m.def("nvlink_host_mapped_free", &host_mapped_free, py::arg("host_ptr"), no_gil);
}
