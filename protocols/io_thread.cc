#include "protocols/io_thread.h"

#include <pthread.h>

#include "common/logging.h"

namespace kvrelay::protocols {

IoThread::IoThread(std::string name) : name_(std::move(name)) {
  work_.emplace(context_.get_executor());
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
    for (;;) {
      try {
        context_.run();
        break;
      } catch (const std::exception& e) {
        // A handler threw: log and keep serving; handlers are not supposed to throw.
        LOG_ERROR << "io thread " << name_ << ": handler threw: " << e.what();
      }
    }
  });
}

IoThread::~IoThread() { Stop(); }

void IoThread::Stop() {
  if (!thread_.joinable()) return;
  work_.reset();
  context_.stop();
  thread_.join();
}

}  // namespace kvrelay::protocols
