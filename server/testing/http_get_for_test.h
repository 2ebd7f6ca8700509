// A minimal HTTP/1.0 GET over a TCP socket, for the tests that read the
// metrics endpoint (no HTTP client library is a dependency of the project).
//
//   absl::StatusOr<HttpResponse> r = HttpGet("127.0.0.1", port, "/metrics");
//   EXPECT_EQ(r->status, 200);
//   EXPECT_THAT(r->body, HasSubstr("specstate_up 1"));
#ifndef SPECSTATE_SERVER_TESTING_HTTP_GET_FOR_TEST_H_
#define SPECSTATE_SERVER_TESTING_HTTP_GET_FOR_TEST_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace specstate {
namespace server {

struct HttpResponse {
  int status = 0;       // e.g. 200
  std::string headers;  // the status line and the headers
  std::string body;
};

// GET `path` from `ipv4`:`port`. UNAVAILABLE when nothing accepts the
// connection; DEADLINE_EXCEEDED when the answer takes longer than `timeout`.
inline absl::StatusOr<HttpResponse> HttpGet(const std::string& ipv4, int port,
                                            const std::string& path,
                                            absl::Duration timeout = absl::Seconds(10)) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, ipv4.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(ipv4, " is not an IPv4 address"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("connect to ", ipv4, ":", port, ": ", std::strerror(errno)));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", ipv4, ":", port, "\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
    sent += n;
  }
  // HTTP/1.0: the server closes the connection after the body.
  std::string raw;
  const absl::Time deadline = absl::Now() + timeout;
  char buffer[4096];
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no complete answer from ", ipv4, ":", port, path, " after ",
                       absl::FormatDuration(timeout), "; got: ", raw));
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) < 0) {
      return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
    }
    if (p.revents == 0) continue;
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    if (n == 0) break;
    raw.append(buffer, n);
  }
  HttpResponse r;
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) {
    return absl::DataLossError(absl::StrCat("no end of the headers in: ", raw));
  }
  r.headers = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  // "HTTP/1.x NNN reason"
  const size_t space = r.headers.find(' ');
  if (space == std::string::npos ||
      !absl::SimpleAtoi(r.headers.substr(space + 1, 3), &r.status)) {
    return absl::DataLossError(absl::StrCat("not an HTTP status line: ", r.headers));
  }
  return r;
}

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_TESTING_HTTP_GET_FOR_TEST_H_
