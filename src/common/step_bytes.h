// A forward's host state as bytes (MoeLayer::step_state / load_step, moe.h): the writer and the
// checked reader both backends share, and the encodings of the host structures they keep for a
// backward (segments, routing tables, the EP dispatch plan). Private to the library.
//
// The bytes start with a header naming the backend and the layer's shape (StepHeader), so that a
// step loaded into a layer it does not fit is refused with what was expected. They are a value:
// the same bytes may be loaded before any number of backwards, into any layer of the same shape.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/tensor.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace step_bytes {

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable<T>::value, "Writer::put: a trivially copyable value");
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable<T>::value, "Writer::put: a vector of trivially copyable values");
    put<int64_t>(static_cast<int64_t>(v.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    out_.insert(out_.end(), p, p + v.size() * sizeof(T));
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

// Reads what a Writer wrote; a read past the end (truncated or foreign bytes) throws
// flowmoe::Error naming `what`.
class Reader {
 public:
  Reader(const uint8_t* bytes, size_t size, const char* what) : p_(bytes), end_(bytes + size), what_(what) {}
  template <typename T>
  void get(T* v) {
    static_assert(std::is_trivially_copyable<T>::value, "Reader::get: a trivially copyable value");
    need(sizeof(T));
    std::memcpy(v, p_, sizeof(T));
    p_ += sizeof(T);
  }
  template <typename T>
  void get(std::vector<T>* v) {
    int64_t n = 0;
    get(&n);
    FLOWMOE_CHECK(n >= 0 && uint64_t(n) <= uint64_t(end_ - p_) / sizeof(T),
                  what_ << ": the step's bytes are truncated or not a step of this layer (a table of " << n
                        << " entries with " << (end_ - p_) << " bytes left); expected the bytes of step_state()");
    v->resize(size_t(n));
    if (n) std::memcpy(v->data(), p_, size_t(n) * sizeof(T));
    p_ += size_t(n) * sizeof(T);
  }
  // after the last field: nothing may be left over
  void finish() const {
    FLOWMOE_CHECK(p_ == end_, what_ << ": " << (end_ - p_) << " bytes left over after the step's state; expected "
                                    << "exactly the bytes of step_state()");
  }
  const char* what() const { return what_; }

 private:
  void need(size_t n) const {
    FLOWMOE_CHECK(size_t(end_ - p_) >= n, what_ << ": the step's bytes are truncated (" << (end_ - p_) << " left, "
                                                << n << " needed); expected the bytes of step_state()");
  }
  const uint8_t* p_;
  const uint8_t* end_;
  const char* what_;
};

// What a step's bytes start with: the backend and the shape of the layer that made them.
struct StepHeader {
  uint32_t magic = 0x504d4c46;  // "FLMP"
  uint32_t version = 1;
  uint8_t backend = 0;          // 0: cpu, 1: cuda
  uint8_t recipe = 0;
  int32_t experts = 0, local_experts = 0, topk = 0;
  int64_t hidden = 0, ffn = 0, max_tokens = 0;
};
StepHeader step_header(const MoeConfig& cfg, int local_experts, bool cuda);
void put_header(Writer& w, const StepHeader& h);
// Reads the header and checks it against `expected` (the loading layer's): throws naming the field.
void check_header(Reader& r, const StepHeader& expected);

void put(Writer& w, const Segments& s);
void get(Reader& r, Segments* s);
void put(Writer& w, const cpu::Routing& rt);
void get(Reader& r, cpu::Routing* rt);
void put(Writer& w, const DispatchPlan& p);
void get(Reader& r, DispatchPlan* p);
void put(Writer& w, const QTensor& q);
void get(Reader& r, QTensor* q);

}  // namespace step_bytes
}  // namespace flowmoe
