// One incoming gRPC call of any method: a Predict the front can serve is answered from its batcher; anything else
// is proxied to the Python server: client messages go up as they come, the server's go down, its status ends the call.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_callback.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "front/log.h"
#include "front/tables.h"
#include "recship/model.h"
#include "recship/serving/v1/predictor.pb.h"

namespace recship::front {

class Batcher;
class Front;

class Call : public grpc::ServerGenericBidiReactor {
 public:
  Call(Front* front, grpc::GenericCallbackServerContext* ctx);

  // -- native Predict (called by the batcher) --
  const recship::Prepared& prepared() const { return prepared_; }
  Clock::time_point enqueued() const { return enqueued_; }
  bool cancelled() const { return cancelled_.load(); }
  bool expired() const { return std::chrono::system_clock::now() > ctx_->deadline(); }
  void answer(const recship::NamedOutputs& outputs, const std::string& model, int64_t version);
  void refuse(const Refusal& refusal, const std::map<std::string, std::string>& fields = {});

  // -- grpc --
  // No lock is held around a call into gRPC: the call may end (OnDone deletes this) before it returns.
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;  // proxy only: a message of the Python server reached the client
  void OnCancel() override;
  void OnDone() override;

 private:
  bool serve_natively();
  void finish_native(const grpc::Status& status, const std::string& label, grpc::ByteBuffer* response);
  bool proxying();
  void start_proxy(bool have_message);

  // The client side of a proxied call.
  struct Upstream : grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
    explicit Upstream(Call* c) : call(c) {}
    void OnReadDone(bool ok) override;
    void OnWriteDone(bool ok) override;
    void OnDone(const grpc::Status& status) override { call->Finish(status); }  // the last thing either side does
    Call* call;
  };

  Front* front_;
  grpc::GenericCallbackServerContext* ctx_;
  const Clock::time_point started_;
  Clock::time_point enqueued_;
  std::mutex mu_;  // guards proxying_
  std::atomic<bool> cancelled_{false};
  bool proxying_ = false;
  grpc::ByteBuffer up_, down_;
  recship::serving::v1::PredictRequest request_;  // parsed, until its values are copied into the model's request
  std::string request_id_;
  recship::Prepared prepared_;
  std::shared_ptr<Batcher> batcher_;
  int64_t admitted_ = 0;
  grpc::ClientContext uctx_;
  Upstream upstream_{this};
};

// Makes a Call for every incoming call, whatever its method.
class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(Front* front) : front_(front) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override { return new Call(front_, ctx); }

 private:
  Front* front_;
};

}  // namespace recship::front
