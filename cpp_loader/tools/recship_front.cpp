// recship_front: the C++ gRPC front of `recship serve --front cpp`. It listens on the server's gRPC port and
// answers recship.serving.v1.Predictor/Predict itself (parsing, validation, dynamic batching and the forward in
// C++: no Python per request) for the model versions the Python server tells it to serve. Every other call goes
// byte for byte to the Python server behind it (--backend), which answers as it always does: other methods
// (KServe v2, metadata, health, reflection), models or versions the front does not serve, and every Predict the
// front would refuse (it cannot parse it, a check fails, it is over the size limit), so error statuses and
// messages are the Python server's own.
//
//   recship_front --listen HOST:PORT --backend ADDRESS --tables JSON --settings JSON [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]
//
// --settings: the server's settings by ServerConfig's field names (serving/front.py): max_batch_size, max_delay_ms,
// batching, max_queue, torch_threads (each model's default: a "load" may override them), max_message_bytes,
// max_inflight_bytes; one spelling, the one config files and the load command's settings use.
//
// --tables: what the front counts and says as the Python server does (buckets, status names, refusal messages),
// from serving/front.py front_tables(); the front has no copy of its own (front/tables.h).
//
// The Python server is the control plane: one JSON command a line on stdin, one JSON answer a line on stdout:
//   {"op": "load", "model": M, "version": V, "path": DIR, "format": "auto", "settings": {...}} -> {"ok": true, "format": "aoti"}
//     (settings, optional: max_batch_size, max_delay_ms, batching, max_queue, torch_threads: the model's own, else the flags';
//     manifest_sha256, optional: the only manifest.json it may load, the one Python verified: LoadOptions::trusted)
//   {"op": "unload", "model": M}                                           -> {"ok": true}
//   {"op": "stats"}                                                         -> {"ok": true, "stats": [...]}
//   {"op": "tables"}                                                        -> {"ok": true, "tables": {...}} (as it took them)
//   {"op": "message_kind", "message": TEXT}                                 -> {"ok": true, "kind": ...} (the sampled log's rule)
//   {"op": "stop", "grace_s": 5}                                            -> {"ok": true}, then it exits
// (an error answers {"ok": false, "error": "..."}). The first stdout line is {"listening": PORT}; stdin closing
// (the parent is gone) stops the front as "stop" does. Log lines go to stderr.
//
// Its parts (front/): log (JSON lines, sampled), tables (the shared definitions), stats (the counts), admission
// (request bytes in flight), batcher (one per served version), front (the served versions), call (one gRPC call,
// native or proxied), control (the commands), server (the start).
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "args.h"
#include "front/call.h"
#include "front/control.h"
#include "front/front.h"
#include "front/log.h"
#include "front/server.h"

namespace {

int usage(const std::string& why) {
  std::cerr << "recship_front: " << why << "\nusage: recship_front --listen HOST:PORT --backend ADDRESS --tables JSON --settings JSON "
               "[--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace recship::front;
  Config c;
  std::string tables, settings;
  recship::args::Flags flags;
  flags.text("--listen", &c.listen).text("--backend", &c.backend).text("--tables", &tables).text("--settings", &settings);
  flags.text("--tls-cert", &c.tls_cert).text("--tls-key", &c.tls_key).text("--tls-client-ca", &c.tls_client_ca);
  if (const recship::args::Problem p = flags.parse(argc, argv)) {
    using Kind = recship::args::Problem::Kind;
    if (p.kind == Kind::kMissingValue) return usage(p.flag + " needs a value");
    if (p.kind == Kind::kUnknown) return usage("unknown option " + p.flag);
    return usage("a numeric option has a value that is not a number");
  }
  if (c.listen.empty() || c.backend.empty()) return usage("--listen and --backend are required");
  if (c.tls_cert.empty() != c.tls_key.empty()) return usage("--tls-cert and --tls-key go together");
  if (tables.empty() || settings.empty()) return usage("--tables and --settings are required (serving/front.py)");
  try {
    const nlohmann::json given = nlohmann::json::parse(settings);
    c.defaults = batching_of(given, c.defaults);
    c.max_message_bytes = given.value("max_message_bytes", c.max_message_bytes);
    c.max_inflight_bytes = given.value("max_inflight_bytes", c.max_inflight_bytes);
    c.tables = Tables::parse(tables);
  } catch (const std::exception& e) {
    return usage(e.what());
  }

  start_log(c.tables.log_interval_s, c.tables.log_max_kinds);
  Front front(std::move(c));
  Service service(&front);
  int port = 0;
  std::string why;
  std::unique_ptr<grpc::Server> server = start_server(front.config, &service, &port, &why);
  if (!server) {
    // {"ok": false, "error": "cannot listen on HOST:PORT: address already in use"} (one line, exit 1):
    // serving/front.py raises it and `recship serve` says it, as for its HTTP and metrics ports.
    release_start_logs(false);
    reply({{"ok", false}, {"error", why}});
    return 1;
  }
  release_start_logs(true);
  reply({{"listening", port}});

  const double grace = run_commands(front, std::cin);
  front.accepting = false;  // (its Predicts go to the Python server, which answers UNAVAILABLE once it closes)
  front.close_windows();    // so a call waiting for company runs now, not at the end of its max_delay_ms
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace * 1000)));
  front.unload_all();
  sampled_log().flush();
  reply({{"ok", true}});
  // Every call has ended and every model is freed: the process ends here. Destroying the server and libtorch's
  // statics took up to half a second more, which the Python server waits for before its own listeners close.
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(0);
}
