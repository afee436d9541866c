// Device-side waiting on flags another kernel (or another GPU) writes: acquire loads and the one timed spin loop that
// every wait of the NVLink kernels (nvlink.h) and of the wave GEMM (waves.h) goes through. A wait that runs out of
// time records why in the Buffer's host-mapped error word, sets the Buffer's abort flag (so every later wait gives up
// at once) and returns false: the kernel runs on and the host raises at its next check, never a hang. A peer that
// gave up can set the abort flag too (kAbortByPeer, below).
// Torch-free; device code only.
#pragma once

#if defined(__CUDACC__)
namespace ep_comm {

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long ld_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The error word's layout (the Python side decodes it): bit 63 set, stage << 48, peer (or what) << 32, call number.
__device__ __forceinline__ unsigned long long timeout_error_word(int stage, int peer, unsigned long long epoch) {
  return (1ull << 63) | (static_cast<unsigned long long>(stage & 0xFF) << 48) |
         (static_cast<unsigned long long>(peer & 0xFFFF) << 32) | (epoch & 0xFFFFFFFFull);
}

// The error word's peer field when the error concerns no single peer or expert (the exchanged counts, the wave layout;
// the Python decoder, ep_comm/backends/nvlink.py, says so).
constexpr int kErrorNoPeer = 0xFFFF;

// The abort word of a Buffer (in its symmetric region, so that peers can set it): 0 while healthy, kAbortSelf once this
// rank gave up (a timeout or a fault), kAbortByPeer | rank once that peer rank gave up and said so (its call raised
// before launching, e.g. on inputs it rejected: nvlink_give_up.cu). Either way every later wait gives up at once.
constexpr unsigned int kAbortSelf = 1u;
constexpr unsigned int kAbortByPeer = 0x80000000u;
constexpr int kStagePeerGaveUp = 8;  // error-word stage: the peer in the word told this rank it gave up

// A wait that found the abort word set: when a peer set it, the error word names that peer (unless a first error is
// already there), so that the host says why this rank stopped waiting.
__device__ __forceinline__ void note_peer_gave_up(unsigned int abort_value, unsigned long long* error_word) {
  if ((abort_value & kAbortByPeer) == 0u) return;
  volatile unsigned long long* err = error_word;
  if (*err == 0ull) {
    *err = timeout_error_word(kStagePeerGaveUp, static_cast<int>(abort_value & 0xFFFFu), 0ull);
    __threadfence_system();
  }
}

// A fault this rank found itself (a wait that timed out, a row past the result's capacity: nvlink.h row_in_capacity):
// the abort word is set to kAbortSelf by a system-scope compare-and-swap from 0, as a peer's give-up notice is
// (nvlink_give_up.cu), and that compare-and-swap also decides whose reason the error word keeps (the host reports
// the first cause). Only the thread whose swap found 0 writes error_bits; a thread that lost to a peer's notice names
// that peer (note_peer_gave_up), and one that lost to another fault of this rank writes nothing. (Before, every
// faulting thread tested the error word for 0 and stored: two threads that tested at the same time could replace the
// first cause with a later one.) The system fence then makes the words visible to the host, which reads the
// host-mapped error word without a sync, and to later kernels. Between the swap and the store the error word can
// still read 0; the host then reports the fault at a later check, and a wait that finds kAbortSelf gives up without
// reading the error word.
__device__ __forceinline__ void record_fault(unsigned int* abort, unsigned long long* error_word,
                                             unsigned long long error_bits) {
  const unsigned int abort_before = atomicCAS_system(abort, 0u, kAbortSelf);
  if (abort_before == 0u) {
    *reinterpret_cast<volatile unsigned long long*>(error_word) = error_bits;
  } else {
    note_peer_gave_up(abort_before, error_word);
  }
  __threadfence_system();
}

// Spin until done(load()). On a timeout: the fault recorded (record_fault: abort flag set; error_bits() in the error
// word if this was the first cause), false returned. load does the acquire; error_bits is only evaluated
// on a timeout.
template <typename Load, typename Done, typename ErrorBits>
__device__ __forceinline__ bool spin_until(Load load, Done done, unsigned int* abort, unsigned long long* error_word,
                                           unsigned long long timeout_ns, ErrorBits error_bits) {
  if (done(load())) return true;
  const unsigned long long start = global_timer_ns();
  volatile unsigned int* abort_flag = abort;
  while (true) {
    if (done(load())) return true;
    if (const unsigned int abort_value = *abort_flag) {
      note_peer_gave_up(abort_value, error_word);
      return false;
    }
    if (global_timer_ns() - start > timeout_ns) {
      record_fault(abort, error_word, error_bits());
      return false;
    }
  }
}

}  // namespace ep_comm
#endif  // __CUDACC__
