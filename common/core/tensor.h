// common/core/tensor.h — the tensor: shape, storage on a device, dtype, autograd slot.
//
// Design rules:
//  * Always contiguous and row-major. Views (reshape, detach) share storage;
//    every other op writes a new tensor.
//  * float32 data; int64 only for index tensors (top-k, routing, targets); bfloat16 (the bits
//    of kernels/bf16.h) for mixed precision, made by cast() and multiplied by matmul(); FP8
//    e4m3 (kernels/fp8.h) as quantized storage only, beside its scales (kernels' fp8_*).
//  * Storage lives on one device (cpu, sim, cuda) and is moved with .to(device).
//  * Random tensors come from a counter-based RNG: element i of a tensor of seed s
//    is a pure function of (s, i), so any rank can generate any slice of a
//    global tensor and the whole is bit-identical whatever the world size.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/device.h"

namespace ff {

enum class DType { f32, i64, bf16, fp8 };
const char* dtype_name(DType t);
size_t dtype_size(DType t);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

struct Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  Device device = Device::cpu;
  Storage(size_t bytes, Device d);
  ~Storage();
  // Frees the memory and keeps the object: every tensor sharing the storage sees it gone, and a
  // later allocate() gives them all new memory (its contents undefined). PyTorch's
  // storage.resize_(0) and back, as FSDP uses it: ZeRO-3 frees a unit's parameters between
  // its forward and its backward (lesson 08's ZeRO-3, lessons/08_mesh/fsdp.h). Reading a released storage is an
  // error, not a crash.
  void release();
  void allocate(size_t bytes);
  bool released = false;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

struct Node;
struct TensorImpl {
  Shape shape;
  DType dtype = DType::f32;
  std::shared_ptr<Storage> storage;
  // autograd
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;   // accumulated gradient of a leaf
  std::shared_ptr<Node> grad_fn;      // the op that produced this tensor, if any
  // A leaf's hook, called once per backward that reaches the leaf, as soon as the last op that
  // read it has had its turn and its gradient is in .grad (PyTorch's
  // register_post_accumulate_grad_hook); also when none of them sent it a gradient (.grad then
  // unchanged). A weight whose gradient a split backward defers: when its W has run.
  // lesson 08's gradient buckets (lessons/08_mesh/buckets.h) start a bucket's reduction there, while the rest of the backward
  // runs. Empty: none.
  std::function<void()> post_accumulate_grad;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- construction
  static Tensor empty(const Shape& shape, Device d = Device::cpu, DType t = DType::f32);
  static Tensor zeros(const Shape& shape, Device d = Device::cpu, DType t = DType::f32);
  static Tensor full(const Shape& shape, float value, Device d = Device::cpu);
  static Tensor from_vector(const std::vector<float>& v, const Shape& shape,
                            Device d = Device::cpu);
  static Tensor from_indices(const std::vector<int64_t>& v, const Shape& shape,
                             Device d = Device::cpu);

  // ---- shape and storage
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  int64_t dim() const { return (int64_t)shape().size(); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape()); }
  DType dtype() const;
  Device device() const;
  size_t nbytes() const { return (size_t)numel() * dtype_size(dtype()); }
  float* data() const;           // f32 storage on any device (a device pointer off cpu)
  int64_t* index_data() const;   // i64 storage
  uint16_t* bf16_data() const;   // bf16 storage: the bits (kernels/bf16.h)
  uint8_t* fp8_data() const;     // fp8 storage: e4m3 bits (kernels/fp8.h)
  void* raw() const;

  // ---- host access (copies through the host for non-cpu devices)
  std::vector<float> to_vector() const;  // float32; bf16 and fp8 widened to float32 (unscaled)
  std::vector<int64_t> to_index_vector() const;
  float item() const;  // one-element tensor

  // ---- copies and views
  Tensor to(Device d) const;
  Tensor clone() const;
  // A float32 tensor as bf16 (rounded to nearest even) or a bf16 one as float32 (exact): a new
  // tensor on the same device, not recorded by autograd (ops.h's cast() is the recorded op).
  Tensor to_dtype(DType t) const;
  Tensor detach() const;                 // same storage, no autograd history
  Tensor view(const Shape& shape) const; // same storage, new shape (no autograd; see ops reshape)
  // Writes src's values into this tensor's storage, in place: every Tensor sharing the
  // storage sees them. Same shape, dtype and device; not recorded by autograd, so call it
  // where no pending backward still needs the old values (e.g. an optimizer step).
  void copy_from(const Tensor& src) const;

  // ---- autograd
  bool requires_grad() const;
  Tensor& requires_grad_(bool on = true);
  Tensor grad() const;       // undefined until backward() reaches this leaf
  void zero_grad();
  void backward() const;     // for a one-element tensor: seeds d(self)/d(self) = 1
  void backward(const Tensor& grad_output) const;

  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// ---- counter-based random tensors
// Standard normal N(0, 1) values; element i is a function of (seed, i) only.
Tensor randn(const Shape& shape, uint64_t seed, Device d = Device::cpu);
// Uniform in [lo, hi).
Tensor rand_uniform(const Shape& shape, uint64_t seed, float lo, float hi, Device d = Device::cpu);
// Uniform integers in [0, high), as an index tensor.
Tensor randint(const Shape& shape, uint64_t seed, int64_t high, Device d = Device::cpu);
// The slice [begin, end) along `dim` of randn(global_shape, seed), generated directly:
// for any split of the range, the concatenation of slices equals randn(global_shape, seed)
// bit for bit.
Tensor randn_slice(const Shape& global_shape, int64_t dim, int64_t begin, int64_t end,
                   uint64_t seed, Device d = Device::cpu);
// The [begin, end) = [r*n/P, (r+1)*n/P) of n items that part r of P gets: sizes differ by
// at most one, and P need not divide n. The one split rule used everywhere.
void split_range(int64_t n, int64_t P, int64_t r, int64_t* begin, int64_t* end);

}  // namespace ff
