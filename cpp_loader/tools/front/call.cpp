#include "front/call.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <vector>

#include "front/batcher.h"
#include "front/front.h"

namespace recship::front {

namespace pb = recship::serving::v1;

namespace {
const char* const kPredict = "/recship.serving.v1.Predictor/Predict";
}  // namespace

Call::Call(Front* front, grpc::GenericCallbackServerContext* ctx) : front_(front), ctx_(ctx), started_(Clock::now()) {
  StartRead(&up_);
}

void Call::answer(const recship::NamedOutputs& outputs, const std::string& model, int64_t version) {
  pb::PredictResponse response;
  response.set_model_name(model);
  response.set_model_version(version);
  response.set_request_id(request_id_);
  for (const auto& [name, out] : outputs) {
    pb::Tensor* t = response.add_outputs();
    t->set_name(name);
    for (int64_t d : out.shape) t->add_shape(d);
    t->mutable_values()->Add(out.values.begin(), out.values.end());
  }
  std::string bytes = response.SerializeAsString();
  grpc::Slice slice(bytes);
  down_ = grpc::ByteBuffer(&slice, 1);
  finish_native(grpc::Status::OK, front_->config.tables.answered, &down_);
}

void Call::refuse(const Refusal& refusal, const std::map<std::string, std::string>& fields) {
  finish_native(refusal.grpc_status(fields), refusal.status, nullptr);
}

void Call::OnReadDone(bool ok) {
  if (proxying()) {  // the next client message, or its half-close
    if (ok) {
      upstream_.StartWrite(&up_);
    } else {  // the client is done sending (or gone): nothing more goes up
      upstream_.StartWritesDone();
      upstream_.RemoveHold();  // the sending hold (start_proxy)
    }
    return;
  }
  // a client that sent nothing or is gone, another method, or a Predict the front does not take: the Python server
  if (ok && !cancelled_ && ctx_->method() == kPredict && serve_natively()) return;
  batcher_.reset();  // routed but not taken: a proxied call must not keep that version (and its model) alive
  start_proxy(ok);
}

void Call::OnWriteDone(bool ok) {
  if (ok) {
    upstream_.StartRead(&down_);
  } else {  // the client is gone: no more reads upstream, so the upstream call may end
    uctx_.TryCancel();
    upstream_.RemoveHold();  // the receiving hold (start_proxy)
  }
}

void Call::OnCancel() {
  cancelled_ = true;
  if (proxying()) uctx_.TryCancel();  // (ClientContext keeps a cancel that comes before its call starts)
}

void Call::OnDone() {
  if (admitted_) front_->admission.release(admitted_);
  delete this;
}

// The Predict is the front's when it parses, is within the size limit, names a version the front serves and
// passes validation; then it is queued (or refused as the Python server would: overloaded, queue full).
bool Call::serve_natively() {
  if (!front_->accepting) return false;  // stopping: the Python server answers (UNAVAILABLE while it drains)
  const int64_t nbytes = static_cast<int64_t>(up_.Length());
  if (nbytes > front_->config.max_message_bytes) return false;
  {
    grpc::ProtoBufferReader reader(&up_);  // parsed from gRPC's slices: no copy of the bytes
    if (!request_.ParseFromZeroCopyStream(&reader)) return false;
  }
  batcher_ = front_->route(request_.model_name(), request_.model_version());
  if (!batcher_) {
    pb::PredictRequest().Swap(&request_);  // forwarded: the parsed copy is not kept while Python answers
    return false;
  }
  // What the Python server charges a Predict (serving/footprint.py): its bytes plus the rules' tensor_copies times its tensors
  // (ids and values at fixed width: its bytes), held before its arrays are made, so one that does not fit is refused
  // having cost only its bytes and its parse.
  const Tables& tables = front_->config.tables;
  const int64_t cost = nbytes + rules::kTensorCopies * nbytes;
  int64_t total = 0;
  if (!front_->admission.admit(cost, &total)) {
    batcher_.reset();  // refused before it reaches a version, as the Python server does: counted under kUnrouted
    refuse(tables.overloaded, {{"total", std::to_string(total)}, {"limit", std::to_string(front_->admission.limit)}});
    return true;
  }
  admitted_ = cost;
  recship::Request r;
  r.batch_size = request_.batch_size();
  bool named_twice = false;
  for (const auto& f : request_.sparse()) {
    recship::Feature& feature = r.sparse[f.name()];
    named_twice = named_twice || !feature.lengths.empty() || !feature.ids.empty() || !feature.weights.empty();
    feature.lengths.assign(f.lengths().begin(), f.lengths().end());
    feature.ids.assign(f.ids().begin(), f.ids().end());
    feature.weights.assign(f.weights().begin(), f.weights().end());
  }
  named_twice = named_twice || static_cast<size_t>(request_.sparse_size()) != r.sparse.size();
  if (request_.has_dense()) {
    r.dense_rows = request_.dense().rows();
    r.dense_cols = request_.dense().cols();
    r.dense.assign(request_.dense().values().begin(), request_.dense().values().end());
  }
  request_id_ = request_.request_id();
  pb::PredictRequest().Swap(&request_);  // its values are in r now
  bool valid = !named_twice;
  if (valid) {
    try {
      prepared_ = batcher_->model->prepare(r);
    } catch (const recship::InvalidRequest&) {
      valid = false;
    }
  }
  if (!valid) {  // the Python server refuses it with its own message (and counts it)
    front_->admission.release(admitted_);
    admitted_ = 0;
    return false;
  }
  enqueued_ = Clock::now();
  switch (batcher_->submit(this)) {
    case Batcher::Submitted::kQueued:
      return true;
    case Batcher::Submitted::kFull:
      refuse(tables.queue_full, {{"max_queue", std::to_string(batcher_->settings.max_queue)}});
      return true;
    case Batcher::Submitted::kStopped:  // replaced meanwhile: the Python server routes it to the new version
      front_->admission.release(admitted_);
      admitted_ = 0;
      return false;
  }
  return false;
}

void Call::finish_native(const grpc::Status& status, const std::string& label, grpc::ByteBuffer* response) {
  const double seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  const std::string model = batcher_ ? batcher_->name : kUnrouted;
  const std::string version = batcher_ ? std::to_string(batcher_->version) : kUnrouted;
  front_->stats.request(model, version, label, status.ok(), seconds);
  if (!status.ok())  // a sample of the refusals of each status (all are counted)
    sampled_log().log("refused " + label, "WARNING", status.error_message(),
                      {{"method", "Predict"}, {"model", model}, {"version", version}, {"status", label}});
  if (admitted_) {  // answered: its bytes leave the in-flight count before the client sees the answer, as in Python
    front_->admission.release(admitted_);
    admitted_ = 0;
  }
  if (response != nullptr) StartWriteAndFinish(response, grpc::WriteOptions(), status);
  else Finish(status);
}

bool Call::proxying() {
  std::lock_guard<std::mutex> lock(mu_);
  return proxying_;
}

void Call::start_proxy(bool have_message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    proxying_ = true;  // from here OnCancel cancels the upstream call; before, this sees cancelled_
  }
  if (cancelled_) {
    Finish(front_->config.tables.cancelled.grpc_status());
    return;
  }
  uctx_.set_deadline(ctx_->deadline());
  for (const auto& [key, value] : ctx_->client_metadata()) {
    std::string k(key.data(), key.size());
    if (k.rfind("grpc-", 0) == 0 || k == "user-agent" || k == "content-type" || k == "te") continue;
    uctx_.AddMetadata(k, std::string(value.data(), value.size()));
  }
  front_->stub.PrepareBidiStreamingCall(&uctx_, ctx_->method(), grpc::StubOptions(), &upstream_);
  // Two holds keep the upstream call from ending (its OnDone deletes nothing, but after it no operation may be
  // started on it) while either direction may still start one. The Python server's status can arrive while
  // one of its messages is still being written to the client, or while the client's next message (or its
  // half-close) is still being read: the StartRead / StartWrite / StartWritesDone that follows must find the
  // call alive. The receiving hold goes when the reads from upstream end (its OnReadDone false) or the client
  // stops taking messages (OnWriteDone false); the sending hold when the client's messages end (OnReadDone
  // false: StartWritesDone) or the upstream stops taking them (its OnWriteDone false).
  upstream_.AddHold();  // receiving
  upstream_.AddHold();  // sending
  upstream_.StartRead(&down_);
  if (have_message) {
    upstream_.StartWrite(&up_);
  } else {
    upstream_.StartWritesDone();
    upstream_.RemoveHold();  // sending: nothing more goes up
  }
  upstream_.StartCall();
}

void Call::Upstream::OnReadDone(bool ok) {
  if (ok) call->StartWrite(&call->down_);  // on to the client; its OnWriteDone reads the next
  else RemoveHold();                       // receiving: no more messages, the call may end with its status
}

void Call::Upstream::OnWriteDone(bool ok) {
  if (ok) call->StartRead(&call->up_);  // that one is up: read the client's next
  else RemoveHold();                     // sending: upstream takes no more, so no more reads from the client
}

}  // namespace recship::front
