// common/core/tensor.cpp — Tensor storage, copies, views and the counter-based RNG.
#include "common/core/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "kernels/bf16.h"
#include "kernels/fp8.h"
#include "kernels/kernels.h"

namespace ff {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::i64: return "int64";
    case DType::bf16: return "bf16";
    case DType::fp8: return "fp8 e4m3";
  }
  return "?";
}
size_t dtype_size(DType t) { return t == DType::f32 ? 4 : t == DType::i64 ? 8 : t == DType::bf16 ? 2 : 1; }

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); i++) os << (i ? ", " : "") << s[i];
  os << ")";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Storage::Storage(size_t b, Device d) : bytes(b), device(d) { ptr = device_malloc(d, b); }
Storage::~Storage() { device_free(device, ptr); }
void Storage::release() {
  device_free(device, ptr);
  ptr = nullptr, bytes = 0, released = true;
}
void Storage::allocate(size_t b) {
  device_free(device, ptr);
  ptr = device_malloc(device, b), bytes = b, released = false;
}

// ---------------------------------------------------------------------------
// construction

Tensor Tensor::empty(const Shape& shape, Device d, DType t) {
  for (int64_t n : shape) FF_CHECK(n >= 0, "negative dimension in shape " << shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->dtype = t;
  impl->storage = std::make_shared<Storage>((size_t)shape_numel(shape) * dtype_size(t), d);
  return Tensor(impl);
}

Tensor Tensor::zeros(const Shape& shape, Device d, DType t) {
  Tensor out = empty(shape, d, t);
  device_memset_zero(d, out.raw(), out.nbytes());
  return out;
}

Tensor Tensor::full(const Shape& shape, float value, Device d) {
  Tensor out = empty(shape, d);
  kernels_for(d).fill(out.data(), out.numel(), value);
  return out;
}

Tensor Tensor::from_vector(const std::vector<float>& v, const Shape& shape, Device d) {
  FF_CHECK((int64_t)v.size() == shape_numel(shape),
           "from_vector: " << v.size() << " values for shape " << shape_str(shape));
  Tensor out = empty(shape, d);
  device_memcpy(out.raw(), d, v.data(), Device::cpu, out.nbytes());
  return out;
}

Tensor Tensor::from_indices(const std::vector<int64_t>& v, const Shape& shape, Device d) {
  FF_CHECK((int64_t)v.size() == shape_numel(shape),
           "from_indices: " << v.size() << " values for shape " << shape_str(shape));
  Tensor out = empty(shape, d, DType::i64);
  device_memcpy(out.raw(), d, v.data(), Device::cpu, out.nbytes());
  return out;
}

// ---------------------------------------------------------------------------
// accessors

const Shape& Tensor::shape() const {
  FF_CHECK(impl_, "use of an undefined tensor");
  return impl_->shape;
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  FF_CHECK(d >= -n && d < n, "dim " << d << " out of range for shape " << shape_str(shape()));
  return shape()[(size_t)(d < 0 ? d + n : d)];
}

DType Tensor::dtype() const {
  FF_CHECK(impl_, "use of an undefined tensor");
  return impl_->dtype;
}

Device Tensor::device() const {
  FF_CHECK(impl_, "use of an undefined tensor");
  return impl_->storage->device;
}

void* Tensor::raw() const {
  FF_CHECK(impl_, "use of an undefined tensor");
  FF_CHECK(!impl_->storage->released, "use of a tensor " << shape_str(impl_->shape)
                                          << " whose storage is released (ZeRO-3 holds a parameter only "
                                             "around its unit's forward and backward)");
  return impl_->storage->ptr;
}

// The storage as T, when the tensor's dtype is `want` (else one error naming both).
template <typename T>
static T* typed(const Tensor& t, DType want, const char* what) {
  FF_CHECK(t.dtype() == want, "expected " << what << " tensor, got " << dtype_name(t.dtype()));
  return static_cast<T*>(t.raw());
}

float* Tensor::data() const { return typed<float>(*this, DType::f32, "a float32"); }
int64_t* Tensor::index_data() const { return typed<int64_t>(*this, DType::i64, "an int64 index"); }
uint16_t* Tensor::bf16_data() const { return typed<uint16_t>(*this, DType::bf16, "a bf16"); }
uint8_t* Tensor::fp8_data() const { return typed<uint8_t>(*this, DType::fp8, "an fp8"); }

// A narrow float tensor's values on the host, widened to float32 by `widen`.
template <typename T>
static std::vector<float> widened(const Tensor& t, const T* data, float (*widen)(T)) {
  std::vector<T> h((size_t)t.numel());
  device_memcpy(h.data(), Device::cpu, data, t.device(), t.nbytes());
  std::vector<float> v(h.size());
  for (size_t i = 0; i < h.size(); i++) v[i] = widen(h[i]);
  return v;
}

std::vector<float> Tensor::to_vector() const {
  if (dtype() == DType::fp8) return widened(*this, fp8_data(), &fp8_to_float);
  if (dtype() == DType::bf16) return widened(*this, bf16_data(), &bf16_to_float);
  std::vector<float> v((size_t)numel());
  device_memcpy(v.data(), Device::cpu, data(), device(), nbytes());
  return v;
}

std::vector<int64_t> Tensor::to_index_vector() const {
  std::vector<int64_t> v((size_t)numel());
  device_memcpy(v.data(), Device::cpu, index_data(), device(), nbytes());
  return v;
}

float Tensor::item() const {
  FF_CHECK(numel() == 1, "item() of a tensor of shape " << shape_str(shape()));
  return to_vector()[0];
}

// ---------------------------------------------------------------------------
// copies and views

Tensor Tensor::to(Device d) const {
  Tensor out = empty(shape(), d, dtype());
  device_memcpy(out.raw(), d, raw(), device(), nbytes());
  return out;
}

Tensor Tensor::clone() const { return to(device()); }

Tensor Tensor::to_dtype(DType t) const {
  FF_CHECK((dtype() == DType::f32 && t == DType::bf16) || (dtype() == DType::bf16 && t == DType::f32),
           "to_dtype: float32 to bf16 or back, not " << dtype_name(dtype()) << " to " << dtype_name(t));
  Tensor out = empty(shape(), device(), t);
  if (t == DType::bf16)
    kernels_for(device()).to_bf16(out.bf16_data(), data(), numel());
  else
    kernels_for(device()).from_bf16(out.data(), bf16_data(), numel());
  return out;
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape();
  impl->dtype = dtype();
  impl->storage = impl_->storage;
  return Tensor(impl);
}

Tensor Tensor::view(const Shape& new_shape) const {
  for (int64_t n : new_shape)
    FF_CHECK(n >= 0, "view: negative dimension in shape " << shape_str(new_shape));
  FF_CHECK(shape_numel(new_shape) == numel(),
           "cannot view shape " << shape_str(shape()) << " as " << shape_str(new_shape));
  Tensor out = detach();
  out.impl_->shape = new_shape;
  return out;
}

void Tensor::copy_from(const Tensor& src) const {
  FF_CHECK(shape() == src.shape() && dtype() == src.dtype() && device() == src.device(),
           "copy_from: cannot copy a " << dtype_name(src.dtype()) << " tensor of shape "
               << shape_str(src.shape()) << " on " << device_name(src.device()) << " into a "
               << dtype_name(dtype()) << " tensor of shape " << shape_str(shape()) << " on "
               << device_name(device()));
  if (raw() != src.raw()) device_memcpy(raw(), device(), src.raw(), src.device(), nbytes());
}

// ---------------------------------------------------------------------------
// autograd slots

bool Tensor::requires_grad() const { return impl_ && impl_->requires_grad; }

Tensor& Tensor::requires_grad_(bool on) {
  FF_CHECK(dtype() == DType::f32 || dtype() == DType::bf16, "only float32 and bf16 tensors can require grad");
  impl_->requires_grad = on;
  return *this;
}

Tensor Tensor::grad() const {
  FF_CHECK(impl_, "use of an undefined tensor");
  return Tensor(impl_->grad);
}

void Tensor::zero_grad() {
  if (impl_) impl_->grad.reset();
}

void Tensor::backward() const {
  FF_CHECK(numel() == 1, "backward() without a gradient needs a one-element tensor, got shape "
                             << shape_str(shape()));
  run_backward(*this, Tensor::full(shape(), 1.f, device()));
}

void Tensor::backward(const Tensor& grad_output) const { run_backward(*this, grad_output); }

// ---------------------------------------------------------------------------
// counter-based RNG: splitmix64 of (seed, counter), as in Steele et al.,
// "Fast splittable pseudorandom number generators" (OOPSLA 2014).

static inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform double strictly inside (0, 1) from stream `seed`, counter `i`: 52 random bits
// plus one half, scaled by 2^-52, is exact in a double and never 0 or 1 (log(u) is finite).
static inline double uniform01(uint64_t seed, uint64_t i) {
  uint64_t bits = splitmix64(splitmix64(seed) ^ i);
  return ((double)(bits >> 12) + 0.5) * (1.0 / 4503599627370496.0);
}

// Element i of the N(0,1) stream: Box-Muller on the counters 2i and 2i+1.
static inline float normal_at(uint64_t seed, uint64_t i) {
  double u1 = uniform01(seed, 2 * i), u2 = uniform01(seed, 2 * i + 1);
  return (float)(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

Tensor randn_slice(const Shape& global_shape, int64_t dim, int64_t begin, int64_t end,
                   uint64_t seed, Device d) {
  int64_t nd = (int64_t)global_shape.size();
  if (nd == 0) FF_CHECK(dim == 0 && begin == 0 && end == 1, "bad slice of a scalar");
  if (dim < 0) dim += nd;
  FF_CHECK(nd == 0 || (dim >= 0 && dim < nd), "randn_slice: dim out of range");
  int64_t n = nd ? global_shape[(size_t)dim] : 1;
  FF_CHECK(0 <= begin && begin <= end && end <= n,
           "randn_slice: [" << begin << ", " << end << ") outside [0, " << n << ")");
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < dim; i++) outer *= global_shape[(size_t)i];
  for (int64_t i = dim + 1; i < nd; i++) inner *= global_shape[(size_t)i];
  Shape local = global_shape;
  if (nd) local[(size_t)dim] = end - begin;
  std::vector<float> v((size_t)shape_numel(local));
  size_t k = 0;
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = begin; j < end; j++)
      for (int64_t i = 0; i < inner; i++)
        v[k++] = normal_at(seed, (uint64_t)((o * n + j) * inner + i));
  return Tensor::from_vector(v, local, d);
}

Tensor randn(const Shape& shape, uint64_t seed, Device d) {
  if (shape.empty()) return randn_slice(shape, 0, 0, 1, seed, d);
  return randn_slice(shape, 0, 0, shape[0], seed, d);
}

Tensor rand_uniform(const Shape& shape, uint64_t seed, float lo, float hi, Device d) {
  FF_CHECK(lo < hi, "rand_uniform: need lo < hi, got [" << lo << ", " << hi << ")");
  std::vector<float> v((size_t)shape_numel(shape));
  for (size_t i = 0; i < v.size(); i++) {
    // float rounding can land on hi itself (e.g. lo = 1000, hi = 1001, u close to 1):
    // step back to the largest float below hi, so the range stays [lo, hi).
    float x = lo + (hi - lo) * (float)uniform01(seed, i);
    v[i] = x < hi ? x : std::nextafter(hi, lo);
  }
  return Tensor::from_vector(v, shape, d);
}

Tensor randint(const Shape& shape, uint64_t seed, int64_t high, Device d) {
  FF_CHECK(high > 0, "randint: high must be positive");
  std::vector<int64_t> v((size_t)shape_numel(shape));
  // uniform01 can round up to exactly 1.0 (probability 2^-53): clamp so v < high always.
  for (size_t i = 0; i < v.size(); i++)
    v[i] = std::min(high - 1, (int64_t)(uniform01(seed, i) * (double)high));
  return Tensor::from_indices(v, shape, d);
}

void split_range(int64_t n, int64_t P, int64_t r, int64_t* begin, int64_t* end) {
  FF_CHECK(P > 0 && r >= 0 && r < P, "split_range: part " << r << " of " << P);
  *begin = r * n / P;
  *end = (r + 1) * n / P;
}

}  // namespace ff
