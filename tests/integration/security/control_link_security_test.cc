// A worker's control link holds the same pre-authentication limit as the
// servers of every internal port: whoever answers on the coordinator's
// address cannot make a worker buffer a large frame before proving the
// cluster key. (Before: the link accepted frames up to 16 MiB before
// authentication and waited for the rest until its deadline.)
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "common/clock.h"
#include "protocols/cluster_auth.h"
#include "protocols/frame_codec.h"
#include "worker/control_link.h"

namespace kvrelay::worker {
namespace {

// A listener on 127.0.0.1 that answers the first connection with one frame
// header announcing `length` payload bytes followed by 64 of them, then keeps
// the connection open until the test ends.
class RogueCoordinator {
 public:
  explicit RogueCoordinator(uint32_t length) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(listen(fd_, 4), 0);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this, length] {
      client_ = accept(fd_, nullptr, nullptr);
      if (client_ < 0) return;
      unsigned char frame[protocols::kFrameHeaderBytes + 64] = {};
      const uint32_t magic = protocols::kFrameMagic;
      const uint16_t version = protocols::kFrameVersion;
      const uint16_t type = static_cast<uint16_t>(protocols::MessageType::kAuthChallenge);
      std::memcpy(frame, &magic, 4);  // little-endian host, as the codec
      std::memcpy(frame + 4, &version, 2);
      std::memcpy(frame + 6, &type, 2);
      std::memcpy(frame + 8, &length, 4);
      ssize_t n = send(client_, frame, sizeof frame, MSG_NOSIGNAL);
      (void)n;
    });
  }
  ~RogueCoordinator() {
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
    if (client_ >= 0) close(client_);
  }
  uint16_t port() const { return port_; }

 private:
  int fd_ = -1;
  int client_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
};

TEST(ControlLinkSecurityTest, ALargeFrameBeforeAuthenticationClosesTheLinkAtItsHeader) {
  RogueCoordinator rogue(8u << 20);  // 8 MiB: under the 16 MiB frame limit, over 1 KiB
  ControlLink::Options o;
  o.worker_id = "prefill-0";
  o.port = rogue.port();
  auto key = protocols::ClusterKey::Generate();
  ASSERT_TRUE(key.ok());
  o.cluster_key = *key;
  ControlLink link(o);
  proto::RegisterWorker reg;
  reg.set_worker_id("prefill-0");
  const auto start = std::chrono::steady_clock::now();
  Status s = link.Connect(reg, Deadline::After(std::chrono::seconds(20)));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(s.ok());
  // Refused at the header, not after waiting for 8 MiB that never come.
  EXPECT_NE(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_LT(took, 10.0) << s.ToString();
  EXPECT_NE(s.ToString().find(std::to_string(protocols::kMaxUnauthenticatedPayload)),
            std::string::npos)
      << s.ToString();
  EXPECT_FALSE(link.connected());
}

}  // namespace
}  // namespace kvrelay::worker
