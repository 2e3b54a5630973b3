#include "front/server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "front/log.h"

namespace recship::front {

namespace {

// Why a TCP listener cannot bind to HOST:PORT: the error of binding a plain socket to each address it resolves
// to (with SO_REUSEADDR, as gRPC binds; never SO_REUSEPORT), e.g. "address already in use"; empty when every
// address binds, or for port 0 and unix: addresses, which nothing else can hold.
std::string bind_error(const std::string& address) {
  if (address.rfind("unix:", 0) == 0 || address.rfind("unix-abstract:", 0) == 0) return "";
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "";
  std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (port.empty() || port == "0") return "";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0) return "";
  std::string error;
  for (addrinfo* a = found; a != nullptr && error.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EADDRNOTAVAIL && errno != EAFNOSUPPORT) {
      error = std::strerror(errno);
      if (!error.empty()) error[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(error[0])));
    }
    close(fd);
  }
  freeaddrinfo(found);
  return error;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::unique_ptr<grpc::Server> start_server(const Config& config, grpc::CallbackGenericService* service, int* port, std::string* why) {
  const std::string cannot = "cannot listen on " + config.listen;
  // A port another process listens on is refused, not shared: gRPC sets SO_REUSEPORT by default, and then two
  // servers split one port's connections between them. Checked first for every address HOST resolves to, since
  // gRPC starts when any of them binds.
  if (std::string error = bind_error(config.listen); !error.empty()) {
    *why = cannot + ": " + error;
    return nullptr;
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!config.tls_cert.empty()) {
    grpc::SslServerCredentialsOptions ssl(config.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                                       : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    try {
      ssl.pem_key_cert_pairs.push_back({read_file(config.tls_key), read_file(config.tls_cert)});
      if (!config.tls_client_ca.empty()) ssl.pem_root_certs = read_file(config.tls_client_ca);
    } catch (const std::exception& e) {
      *why = e.what();
      return nullptr;
    }
    credentials = grpc::SslServerCredentials(ssl);
  }
  *port = 0;
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(config.listen, credentials, port);
  // twice the limit, as the Python server admits, so an oversized request gets its INVALID_ARGUMENT naming the size
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(2 * config.max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(config.max_message_bytes, INT32_MAX)));
  builder.RegisterCallbackGenericService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server && *port != 0) return server;
  std::string error = bind_error(config.listen);
  if (error.empty()) error = first_start_error().value_or("");  // not a bind error: gRPC's own first complaint, if any
  *why = cannot + (error.empty() ? "" : ": " + error);
  return nullptr;
}

}  // namespace recship::front
