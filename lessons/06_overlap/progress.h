// lessons/06_overlap/progress.h — how MPI moves a message while the rank computes: --progress
// none | test | thread, and the flights (all-to-alls in the air) it polls.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common/comm/comm.h"
#include "common/layers/expert_parallel.h"

namespace ff::f1b {

// MPI progress. Open MPI moves a large message between processes of one node (shared memory,
// rendezvous protocol) only while one of the two is inside an MPI call: a message posted with
// isend and then left alone while both sides compute has not moved when the wait begins.
//   none    start, compute, wait: the data moves in the wait
//   test    MPI_Test on the flights in the air between compute tiles (each op of the
//           attention, each expert), so the data moves while the rank computes
//   thread  a second thread polls them every few tens of microseconds; MPI calls from two
//           threads need MPI_THREAD_SERIALIZED at least (one at a time: a mutex here, which
//           also guards the link model's state), or MPI_THREAD_MULTIPLE without the mutex.
enum class ProgressMode { none, test, thread };

class Progress {
 public:
  Progress(Comm& comm, ProgressMode mode) : comm_(comm), mode_(mode) {
    if (mode_ == ProgressMode::thread) thread_ = std::thread([this] { loop(); });
  }
  ~Progress() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Every MPI call of the main thread holds this lock while a progress thread runs.
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(mu_); }
  void add(ep::RowFlight* f) {
    auto l = lock();
    live_.push_back(f);
  }
  // Waits for f (the watchdog's wait) and takes it off the list.
  Tensor finish(ep::RowFlight* f) {
    auto l = lock();
    live_.erase(std::remove(live_.begin(), live_.end(), f), live_.end());
    return ep::exchange_rows_finish(comm_, *f);
  }
  // [slide:tick]
  // Between compute tiles: with --progress test, one MPI_Test of every flight in the air.
  void tick() {
    if (mode_ != ProgressMode::test) return;
    for (ep::RowFlight* f : live_) ep::exchange_rows_test(comm_, *f);
  }
  // [/slide]
  // Whether f has arrived (polls it): lets a wait run deferred work first.
  bool arrived(ep::RowFlight* f) {
    auto l = lock();
    return ep::exchange_rows_test(comm_, *f);
  }

 private:
  void loop() {
    while (!stop_) {
      {
        auto l = lock();
        for (ep::RowFlight* f : live_) ep::exchange_rows_test(comm_, *f);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(30));
    }
  }
  Comm& comm_;
  ProgressMode mode_;
  std::vector<ep::RowFlight*> live_;
  std::mutex mu_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace ff::f1b
