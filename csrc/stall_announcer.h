// A native one-shot timer for Python's calls that wait without a timeout of their own (NVSHMEM's collective setup:
// init, symmetric allocation and free). If stop() has not come within `seconds`, it writes its message to stderr
// (file descriptor 2) once. Python's threading.Timer cannot do this job: it needs the GIL to fire, and nvshmem4py's
// malloc / free bindings keep the GIL while they block, so a Python timer would stay silent through exactly the hangs
// it is meant to announce. This thread never touches Python. Torch-free, like the rest of the core.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace ep_comm {

class StallAnnouncer {
 public:
  StallAnnouncer(std::string message, double seconds) : message_(std::move(message)) {
    if (!std::isfinite(seconds) || seconds < 0.0 || seconds > 1e9)  // (the duration cast below needs a sane value)
      throw std::invalid_argument("StallAnnouncer: seconds must be finite and in [0, 1e9]");
    thread_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!stop_requested_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return stopped_; })) {
        fired_ = true;
        write_to_stderr(message_);
      }
    });
  }
  StallAnnouncer(const StallAnnouncer&) = delete;
  StallAnnouncer& operator=(const StallAnnouncer&) = delete;
  ~StallAnnouncer() { stop(); }

  // Ends the timer (idempotent, also from two threads at once) and says whether the message was written: the caller
  // can then say that the call it announced did end after all.
  bool stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
    }
    stop_requested_.notify_all();
    std::lock_guard<std::mutex> joining(join_mutex_);  // (two joins of one thread at once are undefined)
    if (thread_.joinable()) thread_.join();
    return fired_;
  }

 private:
  static void write_to_stderr(const std::string& text) {
    size_t written = 0;
    while (written < text.size()) {  // write() may take part of it (a pipe); an error gives up silently
      const ssize_t n = ::write(2, text.data() + written, text.size() - written);
      if (n <= 0) return;
      written += static_cast<size_t>(n);
    }
  }

  std::string message_;
  std::mutex mutex_;
  std::mutex join_mutex_;
  std::condition_variable stop_requested_;
  bool stopped_ = false;
  bool fired_ = false;  // written by the timer thread under mutex_, read after join()
  std::thread thread_;
};

}  // namespace ep_comm
