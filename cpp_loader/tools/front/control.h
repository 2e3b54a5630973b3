// The control plane: the Python server's JSON commands, one a line on stdin, each answered with one JSON line on
// stdout (recship_front.cpp lists them).
#pragma once

#include <istream>
#include <nlohmann/json.hpp>

namespace recship::front {

class Front;
struct Batching;

// `defaults` with the batching settings `given` names (ServerConfig's field names: max_batch_size, max_delay_ms,
// batching, max_queue, torch_threads); throws std::runtime_error for a value out of range.
Batching batching_of(const nlohmann::json& given, const Batching& defaults);

// One JSON answer line on stdout.
void reply(const nlohmann::json& answer);

// Runs commands from `in` until "stop" or the end of `in` (the parent is gone); returns the seconds calls in
// flight get to finish ("stop"'s grace_s, else 5).
double run_commands(Front& front, std::istream& in);

}  // namespace recship::front
