// Python bindings of the NVLink backend (register_nvlink, called by bindings.cpp). Torch-free: every
// tensor arrives as a device address (int), the stream as an int.
//
//   ctx = _C.NvlinkContext(device, config_dict)      # config_dict: the NvlinkConfig fields by name
//   ctx.dispatch(...addresses..., stream)            # layout + quantize/send + receive/expand
//   ctx.combine(...addresses..., stream)             # reduce/RHT/S2F6/send + receive/accumulate
//   _C.nvlink_ipc_* / _C.nvlink_host_mapped_*        # CUDA IPC fallback and the error word
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

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

template <typename T>
T* as_ptr(uintptr_t v) {
  return reinterpret_cast<T*>(v);
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
    c.timeout_ns = get<unsigned long long>(d, "timeout_ns");
    c.peer_bases = as_ptr<const unsigned long long>(get<uintptr_t>(d, "peer_bases"));
    c.local_base = as_ptr<char>(get<uintptr_t>(d, "local_base"));
    c.state = as_ptr<NvlinkState>(get<uintptr_t>(d, "state"));
    c.scratch_pos = as_ptr<int>(get<uintptr_t>(d, "scratch_pos"));
    c.scratch_slot = as_ptr<int>(get<uintptr_t>(d, "scratch_slot"));
    c.expert_count = as_ptr<int>(get<uintptr_t>(d, "expert_count"));
    c.rank_count = as_ptr<int>(get<uintptr_t>(d, "rank_count"));
    c.layout_base = as_ptr<int>(get<uintptr_t>(d, "layout_base"));
    c.error_word = as_ptr<unsigned long long>(get<uintptr_t>(d, "error_word"));
    if (c.topk < 1 || c.topk > kMaxTopk) throw std::invalid_argument("num_topk must be in [1, 32] for nvlink");
    if (c.world < 1 || c.world > kMaxWorld) throw std::invalid_argument("world size out of range for nvlink");
    if (c.hidden % 32 != 0) throw std::invalid_argument("hidden must be a multiple of 32");
    if (c.disp_send_blocks < 1 || c.disp_recv_blocks < 1 || c.comb_send_blocks < 1 || c.comb_recv_blocks < 1)
      throw std::invalid_argument("nvlink kernel block counts must be >= 1");
    select();
    prepare_layout_kernel(c);
    prepare_dispatch_kernels(c);
  }

  void dispatch(uintptr_t x, uintptr_t topk_idx, bool idx_is_int64, uintptr_t topk_weights, int num_tokens,
                uintptr_t send_idx, uintptr_t send_w, uintptr_t out_data, uintptr_t out_scales, uintptr_t out_amax,
                uintptr_t num_per_expert, uintptr_t expert_offsets, uintptr_t src_rank, uintptr_t src_token,
                uintptr_t topk_slot, uintptr_t topk_weight, long long num_rows, uintptr_t recv_count,
                uintptr_t recv_tok, uintptr_t recv_ord, uintptr_t recv_rows, uintptr_t stream) {
    if (num_tokens < 0 || num_tokens > cfg_.max_tokens) throw std::invalid_argument("num_tokens out of range");
    DispatchArgs a{};
    a.x = as_ptr<const void>(x);
    a.topk_idx = as_ptr<const void>(topk_idx);
    a.idx_is_int64 = idx_is_int64 ? 1 : 0;
    a.topk_weights = as_ptr<const float>(topk_weights);
    a.num_tokens = num_tokens;
    a.chunk_tokens = layout_chunk_tokens(num_tokens);
    a.send_idx = as_ptr<int>(send_idx);
    a.send_w = as_ptr<float>(send_w);
    a.out_data = as_ptr<unsigned char>(out_data);
    a.out_scales = as_ptr<unsigned char>(out_scales);
    a.out_amax = as_ptr<float>(out_amax);
    a.num_per_expert = as_ptr<int>(num_per_expert);
    a.expert_offsets = as_ptr<int>(expert_offsets);
    a.src_rank = as_ptr<int>(src_rank);
    a.src_token = as_ptr<int>(src_token);
    a.topk_slot = as_ptr<int>(topk_slot);
    a.topk_weight = as_ptr<float>(topk_weight);
    a.num_rows = num_rows;
    a.recv_count = as_ptr<int>(recv_count);
    a.recv_tok = as_ptr<int>(recv_tok);
    a.recv_ord = as_ptr<int>(recv_ord);
    a.recv_rows = as_ptr<int>(recv_rows);
    select();
    launch_layout(cfg_, a, stream);
    launch_dispatch_send(cfg_, a, stream);
    launch_dispatch_recv(cfg_, a, stream);
  }

  void combine(uintptr_t expert_out, uintptr_t row_weight, bool local_reduce, uintptr_t recv_count,
               uintptr_t recv_tok, uintptr_t recv_ord, uintptr_t recv_rows, uintptr_t send_idx, uintptr_t send_w,
               int num_tokens, uintptr_t out, uintptr_t stream) {
    if (num_tokens < 0 || num_tokens > cfg_.max_tokens) throw std::invalid_argument("num_tokens out of range");
    CombineArgs a{};
    a.expert_out = as_ptr<const unsigned short>(expert_out);
    a.row_weight = as_ptr<const float>(row_weight);
    a.local_reduce = local_reduce ? 1 : 0;
    a.recv_count = as_ptr<const int>(recv_count);
    a.recv_tok = as_ptr<const int>(recv_tok);
    a.recv_ord = as_ptr<const int>(recv_ord);
    a.recv_rows = as_ptr<const int>(recv_rows);
    a.send_idx = as_ptr<const int>(send_idx);
    a.send_w = as_ptr<const float>(send_w);
    a.num_tokens = num_tokens;
    a.out = as_ptr<unsigned short>(out);
    select();
    launch_combine_send(cfg_, a, stream);
    launch_combine_recv(cfg_, a, stream);
  }

  int layout_threads() const { return layout_warps(cfg_) * 32; }
  int comm_threads() const { return kCommThreads; }

 private:
  void select() const {
    const cudaError_t err = cudaSetDevice(device_);
    if (err != cudaSuccess) throw std::runtime_error(std::string("cudaSetDevice: ") + cudaGetErrorString(err));
  }

  int device_;
  NvlinkConfig cfg_{};
};

}  // namespace

void register_nvlink(py::module_& m) {
  py::class_<NvlinkContext>(m, "NvlinkContext",
                            "Static NVLink dispatch/combine state of one Buffer (addresses owned by Python)")
      .def(py::init<int, const py::dict&>(), py::arg("device"), py::arg("config"))
      .def("dispatch", &NvlinkContext::dispatch)
      .def("combine", &NvlinkContext::combine)
      .def_property_readonly("layout_threads", &NvlinkContext::layout_threads)
      .def_property_readonly("comm_threads", &NvlinkContext::comm_threads);
  m.attr("nvlink_state_bytes") = py::int_(sizeof(NvlinkState));
  m.attr("nvlink_max_topk") = py::int_(kMaxTopk);
  m.attr("nvlink_max_world") = py::int_(kMaxWorld);
  m.attr("nvlink_layout_max_chunks") = py::int_(kLayoutMaxChunks);

  m.def("nvlink_device_alloc", &device_alloc_zeroed, py::arg("device"), py::arg("bytes"),
        "cudaMalloc + zero fill (CUDA IPC fallback region); returns the address");
  m.def("nvlink_device_free", &device_free, py::arg("device"), py::arg("ptr"));
  m.def(
      "nvlink_ipc_get_handle",
      [](int device, uintptr_t ptr) {
        unsigned char handle[64];
        ipc_get_handle(device, ptr, handle);
        return py::bytes(reinterpret_cast<const char*>(handle), 64);
      },
      py::arg("device"), py::arg("ptr"), "64-byte cudaIpcMemHandle_t of a cudaMalloc'd address");
  m.def(
      "nvlink_ipc_open_handle",
      [](int device, py::bytes handle) {
        const std::string raw = handle;
        if (raw.size() != 64) throw std::invalid_argument("a CUDA IPC handle has 64 bytes");
        return ipc_open_handle(device, reinterpret_cast<const unsigned char*>(raw.data()));
      },
      py::arg("device"), py::arg("handle"), "map a peer's region; returns the local address of it");
  m.def("nvlink_ipc_close_handle", &ipc_close_handle, py::arg("device"), py::arg("ptr"));
  m.def("nvlink_can_access_peer", &can_access_peer, py::arg("device"), py::arg("peer"));
  m.def(
      "nvlink_host_mapped_alloc",
      [](int device, size_t bytes) {
        uintptr_t host = 0, dev = 0;
        host_mapped_alloc(device, bytes, &host, &dev);
        return py::make_tuple(host, dev);
      },
      py::arg("device"), py::arg("bytes"), "zeroed pinned host memory mapped into the device: (host address, device address)");
  m.def("nvlink_host_mapped_free", &host_mapped_free, py::arg("host_ptr"));
}
