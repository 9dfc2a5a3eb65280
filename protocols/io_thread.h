// One Boost.Asio io_context driven by one named thread. Every async socket of
// a process side (control client, control server, TCP KV data plane) lives on
// such a thread; handlers run there, one at a time.
//
// Lifetime: the IoThread must outlive every socket, timer and connection
// created on its context. Stop() (also run by the destructor) stops the
// context and joins the thread; no thread is ever detached.
#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <optional>
#include <string>
#include <thread>

namespace kvrelay::protocols {

class IoThread {
 public:
  // `name` is the OS thread name (truncated to 15 characters).
  explicit IoThread(std::string name);
  ~IoThread();
  IoThread(const IoThread&) = delete;
  IoThread& operator=(const IoThread&) = delete;

  boost::asio::io_context& context() { return context_; }
  const std::string& name() const { return name_; }
  // True when called from this IoThread's own thread.
  bool InThisThread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Stops the context and joins the thread. Idempotent; not callable from the thread itself.
  void Stop();

 private:
  std::string name_;
  boost::asio::io_context context_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_;
  std::thread thread_;
};

}  // namespace kvrelay::protocols
