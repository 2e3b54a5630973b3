// Starting the front's gRPC server on its public address.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "front/front.h"

namespace recship::front {

// The server on config.listen (TLS when config has a certificate) with `service` taking every call, and its port
// in *port; or null, with why it could not start in one line in *why: "cannot listen on HOST:PORT: address already
// in use", in the words Python's asyncio uses for the HTTP and metrics ports.
std::unique_ptr<grpc::Server> start_server(const Config& config, grpc::CallbackGenericService* service, int* port, std::string* why);

}  // namespace recship::front
