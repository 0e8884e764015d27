// ATen kernels of the simulated Neuron device.
//
// A handful of kernels are registered explicitly (allocation, views, copies);
// every other operator reaches `neuron_fallback`, which runs the CPU kernel on
// zero-copy CPU aliases of the device tensors and maps the results back to the
// device. Each fallback call is one op Neuron's eager mode would compile for
// its (op, shapes, dtypes), so that is what the eager-signature counter keys on,
// except for the ops the real backend itself runs on the CPU (its CPU_FALLBACK
// list, configured from Python): those compile nothing and cost a host round trip
// per call, counted instead. Convolutions have explicit kernels that count the same
// way (their device entry points have no CPU kernel for the fallback to reach).

#include "sim.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <sstream>
#include <tuple>
#include <unordered_set>

namespace nsim {
namespace {

constexpr c10::DispatchKeySet kDeviceKeys(c10::DispatchKey::PrivateUse1);

// Keeps the device storage alive for as long as a CPU alias of it exists:
// gloo work, autograd and DDP's reducer hold aliases past the op that made
// them, and the device tensor may be gone by then.
struct AliasContext {
  c10::intrusive_ptr<c10::StorageImpl> device_storage;
};

void release_alias(void* ctx) {
  delete static_cast<AliasContext*>(ctx);
}

// A CPU tensor over the same memory as `t` (device memory is host memory).
at::Tensor cpu_alias(const at::Tensor& t) {
  const c10::Storage& st = t.storage();
  void* data = const_cast<void*>(st.data());
  auto* ctx = new AliasContext{c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(st.unsafeGetStorageImpl())};
  c10::Storage cpu_storage(
      c10::Storage::use_byte_size_t(),
      st.nbytes(),
      c10::DataPtr(data, ctx, &release_alias, c10::Device(c10::DeviceType::CPU)),
      /*allocator=*/nullptr,
      /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(cpu_storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

at::Tensor empty_on_device(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    c10::ScalarType dtype,
    int device) {
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, device));
  return at::detail::empty_strided_generic(
      size, stride, device_allocator(), kDeviceKeys, dtype);
}

// A new device tensor holding a copy of the CPU result `r`.
at::Tensor upload_result(const at::Tensor& r, int device) {
  at::Tensor out = empty_on_device(r.sizes(), r.strides(), r.scalar_type(), device);
  if (r.numel() > 0) {
    cpu_alias(out).copy_(r);
  }
  return out;
}

// A device view of `base`'s storage with the geometry of the CPU view `r`.
at::Tensor device_view(const at::Tensor& base, const at::Tensor& r) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), r.dtype());
  impl->set_sizes_and_strides(r.sizes(), r.strides(), r.storage_offset());
  return at::Tensor(std::move(impl));
}

int index_of(const at::Tensor& t) {
  return t.device().index() < 0 ? t_device : t.device().index();
}

const char* short_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "f32";
    case c10::ScalarType::Double: return "f64";
    case c10::ScalarType::Half: return "f16";
    case c10::ScalarType::BFloat16: return "bf16";
    case c10::ScalarType::Long: return "i64";
    case c10::ScalarType::Int: return "i32";
    case c10::ScalarType::Short: return "i16";
    case c10::ScalarType::Char: return "i8";
    case c10::ScalarType::Byte: return "u8";
    case c10::ScalarType::Bool: return "bool";
    default: return c10::toString(t);
  }
}

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << short_dtype(t.scalar_type()) << "[";
  for (size_t i = 0; i < t.sizes().size(); ++i) {
    os << (i ? "," : "") << t.sizes()[i];
  }
  os << "]";
  return os.str();
}

// ------------------------------------------------------------ explicit kernels

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory,
    std::optional<c10::MemoryFormat> memory_format) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.is_privateuseone(), "expected a neuron device, got ", dev);
  TORCH_CHECK(
      c10::layout_or_default(layout) == c10::Layout::Strided,
      "only strided tensors are supported on neuron");
  TORCH_CHECK(
      !c10::pinned_memory_or_default(pin_memory),
      "only CPU tensors can be pinned");
  const int index = dev.has_index() ? dev.index() : t_device;
  check_device_index(index);
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, index));
  return at::detail::empty_generic(
      size, device_allocator(), kDeviceKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.is_privateuseone(), "expected a neuron device, got ", dev);
  TORCH_CHECK(
      c10::layout_or_default(layout) == c10::Layout::Strided,
      "only strided tensors are supported on neuron");
  TORCH_CHECK(
      !c10::pinned_memory_or_default(pin_memory),
      "only CPU tensors can be pinned");
  const int index = dev.has_index() ? dev.index() : t_device;
  check_device_index(index);
  return empty_on_device(size, stride, c10::dtype_or_default(dtype), index);
}

at::Tensor as_strided(
    const at::Tensor& self,
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor reshape_alias(
    const at::Tensor& self,
    c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

const at::Tensor& resize_(
    const at::Tensor& self,
    c10::IntArrayRef size,
    std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, size, memory_format);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  (void)non_blocking; // the simulator's transfers are synchronous
  check_usable();
  const int64_t bytes = static_cast<int64_t>(self.numel()) * self.element_size();
  at::Tensor src_cpu = self.is_privateuseone() ? cpu_alias(self) : self;
  at::Tensor dst_cpu = dst.is_privateuseone() ? cpu_alias(dst) : dst;
  if (self.is_privateuseone() && dst.is_privateuseone()) {
    if (index_of(self) != index_of(dst)) {
      g_d2d.fetch_add(bytes);
    } else if (t_suspend_counting == 0) {
      // A copy within a core (a cast, a slice assignment) runs on the device.
      record_signature("aten::copy_(" + describe(dst) + ", " + describe(self) + ")");
    }
  } else if (dst.is_privateuseone()) {
    g_h2d.fetch_add(bytes);
  } else {
    g_d2h.fetch_add(static_cast<int64_t>(dst.numel()) * dst.element_size());
  }
  dst_cpu.copy_(src_cpu);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.is_privateuseone()) {
    resize_(dst, self.sizes(), std::nullopt);
  } else {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  check_usable();
  g_d2h.fetch_add(self.element_size());
  return at::native::_local_scalar_dense_cpu(cpu_alias(self));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, source);
}

at::Tensor& set_source_storage_offset(
    at::Tensor& self,
    at::Storage source,
    int64_t storage_offset,
    c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, storage_offset, size, stride);
}

// Lets `param.data = tensor_on_neuron` (Module.to, Accelerate) keep the same
// Parameter object, as for CUDA; otherwise Module._apply makes new Parameters
// and tied weights come apart. PyTorch's dense-backend list lacks PrivateUse1
// and expects backends to register this (see OpenReg).
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto plain = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() &&
        (t.is_cpu() || t.is_privateuseone());
  };
  return plain(self) && plain(from);
}

// All simulated work is synchronous: no stream can still be using a block.
void record_stream(at::Tensor& self, c10::Stream stream) {
  (void)self;
  (void)stream;
}

at::Tensor cpu_alias_op(const at::Tensor& self) {
  return cpu_alias(self);
}

// A tensor of no elements holding a C++ reference to `t` for as long as it
// lives. A tensor with a Python object takes the GIL whenever its C++ reference
// count falls back to one; held, a gloo thread letting go of `t` never does
// (distributed.py, _HeldAliases).
struct HoldContext {
  at::Tensor held;
};

void release_hold(void* ctx) {
  delete static_cast<HoldContext*>(ctx);
}

at::Tensor hold_op(const at::Tensor& t) {
  c10::Storage storage(
      c10::Storage::use_byte_size_t(),
      0,
      c10::DataPtr(nullptr, new HoldContext{t}, &release_hold, c10::Device(c10::DeviceType::CPU)),
      /*allocator=*/nullptr,
      /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::Make<uint8_t>());
  impl->set_sizes_contiguous({0});
  return at::Tensor(std::move(impl));
}

// ------------------------------------------------------------ fallback

bool is_optional_tensor_list(const c10::TypePtr& type) {
  auto list = type->cast<c10::ListType>();
  if (!list) {
    return false;
  }
  auto opt = list->getElementType()->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::TensorType;
}

// Ops whose CPU kernel has no integer version though a device kernel takes integers
// (torch.histc: CPU and MPS refuse int, CUDA accepts it, and Transformers' MoE
// grouped_mm path calls it on int32 expert ids off the CPU). The simulator
// computes them in float32 (exact for integers below 2^24) and returns the
// input's dtype, as the CUDA kernel does.
const std::unordered_set<std::string>& cpu_kernel_lacks_integers() {
  static const std::unordered_set<std::string> ops = {"aten::histc"};
  return ops;
}

int64_t device_bytes(const at::Tensor& t) {
  return t.defined() && t.is_privateuseone() ? static_cast<int64_t>(t.numel()) * t.element_size() : 0;
}

bool is_generator_arg(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::GeneratorType) {
    return true;
  }
  auto opt = type->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

// Set while an out= kernel is retried with host temporaries (see below).
thread_local bool t_out_temps = false;

struct Binding {
  at::Tensor device_tensor;
  at::Tensor cpu_tensor;
  bool is_out_temp;
};

class DeviceChecker {
 public:
  void see(const at::Tensor& t, const std::string& arg) {
    if (!t.defined()) {
      return;
    }
    if (t.is_privateuseone()) {
      const int d = index_of(t);
      if (device_ < 0) {
        device_ = d;
        device_arg_ = arg;
      } else if (d != device_) {
        fail("neuron:" + std::to_string(device_), "neuron:" + std::to_string(d), arg);
      }
      if (!cpu_arg_.empty()) {
        fail("neuron:" + std::to_string(device_), "cpu", cpu_arg_);
      }
    } else if (t.is_cpu() && t.dim() > 0) {
      if (cpu_arg_.empty()) {
        cpu_arg_ = arg;
      }
      if (device_ >= 0) {
        fail("neuron:" + std::to_string(device_), "cpu", arg);
      }
    }
  }
  int device() const {
    return device_;
  }
  void set_device(int d) {
    if (device_ < 0) {
      device_ = d;
    }
  }

 private:
  [[noreturn]] void fail(const std::string& a, const std::string& b, const std::string& arg) {
    TORCH_CHECK(
        false,
        "Expected all tensors to be on the same device, but found at least two devices, ",
        a,
        " and ",
        b,
        "! (when checking argument '",
        arg,
        "' of ",
        op_,
        ")");
  }

 public:
  std::string op_;

 private:
  int device_ = -1;
  std::string device_arg_;
  std::string cpu_arg_;
};

at::Tensor to_cpu_binding(
    const at::Tensor& t,
    bool is_out,
    std::vector<Binding>& bindings) {
  if (!t.defined() || !t.is_privateuseone()) {
    return t;
  }
  at::Tensor alias = cpu_alias(t);
  if (is_out && t_out_temps) {
    // Retry of an out= kernel that had to grow its output: the alias has
    // fixed-size storage, so the kernel writes into a host temporary that is
    // copied back afterwards.
    at::Tensor temp = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kCPU));
    if (t.numel() > 0) {
      temp.copy_(alias);
    }
    bindings.push_back({t, temp, true});
    return temp;
  }
  bindings.push_back({t, alias, false});
  return alias;
}

at::Tensor from_cpu_result(const at::Tensor& r, int device, const std::vector<Binding>& bindings) {
  if (!r.defined() || !r.is_cpu()) {
    return r;
  }
  for (const auto& b : bindings) {
    if (r.unsafeGetTensorImpl() == b.cpu_tensor.unsafeGetTensorImpl()) {
      return b.device_tensor;
    }
  }
  const void* data = r.storage().data();
  if (data != nullptr) {
    for (const auto& b : bindings) {
      if (!b.is_out_temp && b.cpu_tensor.storage().data() == data) {
        return device_view(b.device_tensor, r);
      }
    }
  }
  return upload_result(r, device);
}

// ------------------------------------------------------------ convolutions

// PyTorch sends a convolution on an out-of-tree device to convolution_overrideable
// (and its gradient to convolution_backward_overrideable), whose CPU kernels only
// raise: the boxed fallback cannot reach a CPU convolution through them. These run
// the CPU's convolution and its backward on aliases of the device tensors, so the
// results are the CPU's bit for bit, and count like the fallback: one eager
// signature per (op, shapes, dtypes, geometry) outside a compiled graph, or a host
// round trip when the op is on the CPU-fallback list. The geometry (stride,
// padding, dilation, transposition, groups) is part of the signature because it
// changes the program a convolution compiles to, not only its output shape.

std::string int_list(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    s += (i ? "," : "") + std::to_string(v[i]);
  }
  return s + "]";
}

struct ConvGeometry {
  c10::IntArrayRef stride;
  c10::IntArrayRef padding;
  c10::IntArrayRef dilation;
  bool transposed;
  c10::IntArrayRef output_padding;
  int64_t groups;

  std::string describe() const {
    std::string s = "stride=" + int_list(stride) + ", padding=" + int_list(padding) +
        ", dilation=" + int_list(dilation);
    if (transposed) {
      s += ", transposed, output_padding=" + int_list(output_padding);
    }
    return s + ", groups=" + std::to_string(groups);
  }
};

// Checks devices, counts the call, and returns the core it runs on.
int account_convolution(
    const char* op,
    std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors,
    const ConvGeometry& geometry,
    int64_t* host_in_bytes) {
  check_usable();
  DeviceChecker checker;
  checker.op_ = op;
  std::string signature = std::string(op) + "(";
  bool first = true;
  for (const auto& [name, t] : tensors) {
    checker.see(*t, name);
    if (t->defined()) {
      signature += (first ? "" : ", ") + describe(*t);
      first = false;
      *host_in_bytes += device_bytes(*t);
    }
  }
  if (checker.device() < 0) {
    checker.set_device(t_device);
  }
  check_device_index(checker.device());
  if (t_suspend_counting == 0 && !is_cpu_fallback_op(op)) {
    record_signature(signature + ", " + geometry.describe() + ")");
  }
  return checker.device();
}

at::Tensor host_view(const at::Tensor& t) {
  return t.defined() && t.is_privateuseone() ? cpu_alias(t) : t;
}

// The CPU result `r` on core `device` (an empty tensor when `r` is undefined).
at::Tensor to_device(const at::Tensor& r, int device, int64_t* host_out_bytes) {
  if (!r.defined()) {
    return r;
  }
  at::Tensor out = upload_result(r, device);
  *host_out_bytes += device_bytes(out);
  return out;
}

void note_host_round_trip(const char* op, int64_t in_bytes, int64_t out_bytes) {
  if (t_suspend_counting == 0 && is_cpu_fallback_op(op)) {
    record_cpu_fallback(op, in_bytes, out_bytes);
  }
}

at::Tensor convolution_overrideable(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::IntArrayRef stride,
    c10::IntArrayRef padding,
    c10::IntArrayRef dilation,
    bool transposed,
    c10::IntArrayRef output_padding,
    int64_t groups) {
  static const char* kOp = "aten::convolution_overrideable";
  const at::Tensor no_bias;
  const at::Tensor& b = bias.has_value() ? *bias : no_bias;
  const ConvGeometry geometry{stride, padding, dilation, transposed, output_padding, groups};
  int64_t in_bytes = 0, out_bytes = 0;
  const int device = account_convolution(
      kOp, {{"input", &input}, {"weight", &weight}, {"bias", &b}}, geometry, &in_bytes);
  const std::optional<at::Tensor> host_bias =
      b.defined() ? std::optional<at::Tensor>(host_view(b)) : std::nullopt;
  at::Tensor r = at::convolution(
      host_view(input), host_view(weight), host_bias, stride, padding, dilation, transposed, output_padding, groups);
  at::Tensor out = to_device(r, device, &out_bytes);
  note_host_round_trip(kOp, in_bytes, out_bytes);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    c10::IntArrayRef stride,
    c10::IntArrayRef padding,
    c10::IntArrayRef dilation,
    bool transposed,
    c10::IntArrayRef output_padding,
    int64_t groups,
    std::array<bool, 3> output_mask) {
  static const char* kOp = "aten::convolution_backward_overrideable";
  const ConvGeometry geometry{stride, padding, dilation, transposed, output_padding, groups};
  int64_t in_bytes = 0, out_bytes = 0;
  const int device = account_convolution(
      kOp, {{"grad_output", &grad_output}, {"input", &input}, {"weight", &weight}}, geometry, &in_bytes);
  // The bias has one value per output channel: weight is (out, in/groups, ...) or, transposed,
  // (in, out/groups, ...).
  const std::vector<int64_t> bias_sizes = {transposed ? weight.size(1) * groups : weight.size(0)};
  auto [gi, gw, gb] = at::convolution_backward(
      host_view(grad_output),
      host_view(input),
      host_view(weight),
      output_mask[2] ? std::optional<c10::IntArrayRef>(bias_sizes) : std::nullopt,
      stride,
      padding,
      dilation,
      transposed,
      output_padding,
      groups,
      output_mask);
  auto result = std::make_tuple(
      to_device(gi, device, &out_bytes), to_device(gw, device, &out_bytes), to_device(gb, device, &out_bytes));
  note_host_round_trip(kOp, in_bytes, out_bytes);
  return result;
}

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  check_usable();
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t num_args = arguments.size();
  const size_t begin = stack->size() - num_args;
  const std::string& base_name = schema.operator_name().name;
  // On Trainium a CPU_FALLBACK op compiles nothing: it is a host round trip, not an eager signature.
  const bool on_host = t_suspend_counting == 0 && is_cpu_fallback_op(base_name);
  const bool counting = t_suspend_counting == 0 && !on_host;
  const bool integers_via_float = cpu_kernel_lacks_integers().count(base_name) > 0;
  std::optional<c10::ScalarType> integer_dtype;
  int64_t host_in_bytes = 0;

  DeviceChecker checker;
  checker.op_ = base_name;
  if (!schema.overload_name().empty()) {
    checker.op_ += "." + schema.overload_name();
  }
  std::string signature;
  if (counting) {
    signature = checker.op_ + "(";
  }
  bool first_part = true;
  auto add_part = [&](const std::string& part) {
    signature += (first_part ? "" : ", ") + part;
    first_part = false;
  };
  std::vector<Binding> bindings;
  std::vector<size_t> generator_slots;
  int device_arg = -1;

  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& v = (*stack)[begin + i];
    const auto& arg = arguments[i];
    const bool is_out =
        arg.alias_info() && arg.alias_info()->isWrite() && arg.kwarg_only();
    if (v.isTensor()) {
      const at::Tensor t = v.toTensor();
      checker.see(t, arg.name());
      if (counting && t.defined()) {
        add_part(describe(t));
      }
      host_in_bytes += device_bytes(t);
      v = to_cpu_binding(t, is_out, bindings);
      if (integers_via_float && !is_out && t.defined() && t.is_privateuseone() &&
          c10::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
        integer_dtype = t.scalar_type();
        v = v.toTensor().to(at::kFloat);
      }
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> converted;
      converted.reserve(list.size());
      std::string part = "[";
      for (const at::Tensor& t : list) {
        checker.see(t, arg.name());
        if (counting) {
          part += (part.size() > 1 ? ", " : "") + describe(t);
        }
        host_in_bytes += device_bytes(t);
        converted.push_back(to_cpu_binding(t, false, bindings));
      }
      if (counting) {
        add_part(part + "]");
      }
      v = converted;
    } else if (v.isList() && is_optional_tensor_list(arg.type())) {
      // Index lists: like CUDA, index tensors may live on the host.
      auto list = v.toOptionalTensorList();
      c10::List<std::optional<at::Tensor>> converted;
      std::string part = "[";
      for (const std::optional<at::Tensor>& ot : list) {
        const bool present = ot.has_value() && ot->defined();
        if (counting) {
          part += (part.size() > 1 ? ", " : "") + (present ? describe(*ot) : std::string("None"));
        }
        if (present) {
          host_in_bytes += device_bytes(*ot);
          converted.push_back(to_cpu_binding(*ot, false, bindings));
        } else {
          converted.push_back(std::nullopt);
        }
      }
      if (counting) {
        add_part(part + "]");
      }
      v = converted;
    } else if (v.isDevice()) {
      const c10::Device d = v.toDevice();
      if (d.is_privateuseone()) {
        device_arg = d.has_index() ? d.index() : t_device;
        v = c10::Device(c10::DeviceType::CPU);
      }
    } else if (is_generator_arg(arg.type())) {
      generator_slots.push_back(begin + i);
    }
  }

  if (checker.device() < 0) {
    checker.set_device(device_arg >= 0 ? device_arg : t_device);
  }
  const int device = checker.device();
  check_device_index(device);
  for (size_t slot : generator_slots) {
    c10::IValue& v = (*stack)[slot];
    at::Generator gen = v.isNone() ? default_generator(device) : v.toGenerator();
    v = cpu_generator_for(gen);
  }
  if (counting) {
    signature += ")";
    record_signature(std::move(signature));
  }

  // Keep the converted arguments: an out= kernel that must grow its output
  // cannot do so through a fixed-size alias and is retried on temporaries.
  std::vector<c10::IValue> saved;
  if (!t_out_temps && schema.is_mutable()) {
    saved.assign(stack->begin() + begin, stack->end());
  }
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  } catch (const c10::Error& e) {
    const bool resize_failure =
        std::string(e.what()).find("not resizable") != std::string::npos;
    if (t_out_temps || saved.empty() || !resize_failure) {
      throw;
    }
    stack->resize(begin);
    std::vector<Binding> retry_bindings;
    t_out_temps = true;
    try {
      for (size_t i = 0; i < num_args; ++i) {
        c10::IValue v = saved[i];
        const auto& arg = arguments[i];
        const bool is_out =
            arg.alias_info() && arg.alias_info()->isWrite() && arg.kwarg_only();
        if (is_out && v.isTensor()) {
          // Find the device tensor behind this alias.
          for (const auto& b : bindings) {
            if (b.cpu_tensor.unsafeGetTensorImpl() == v.toTensor().unsafeGetTensorImpl()) {
              v = to_cpu_binding(b.device_tensor, true, retry_bindings);
            }
          }
        }
        stack->push_back(std::move(v));
      }
      t_out_temps = false;
    } catch (...) {
      t_out_temps = false;
      throw;
    }
    for (auto& b : retry_bindings) {
      bindings.push_back(b);
    }
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }

  // out= kernels wrote into host temporaries: copy them back to the device.
  for (const auto& b : bindings) {
    if (b.is_out_temp) {
      at::Tensor dst = b.device_tensor;
      if (dst.sizes() != b.cpu_tensor.sizes()) {
        resize_(dst, b.cpu_tensor.sizes(), std::nullopt);
      }
      if (b.cpu_tensor.numel() > 0) {
        cpu_alias(dst).copy_(b.cpu_tensor);
      }
    }
  }

  const size_t num_returns = schema.returns().size();
  const size_t rbegin = stack->size() - num_returns;
  int64_t host_out_bytes = 0;
  for (size_t j = 0; j < num_returns; ++j) {
    c10::IValue& v = (*stack)[rbegin + j];
    if (v.isTensor()) {
      at::Tensor r = v.toTensor();
      if (integer_dtype && r.defined() && r.is_floating_point()) {
        r = r.to(*integer_dtype);
      }
      v = from_cpu_result(r, device, bindings);
      host_out_bytes += device_bytes(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> converted;
      converted.reserve(list.size());
      for (const at::Tensor& t : list) {
        converted.push_back(from_cpu_result(t, device, bindings));
        host_out_bytes += device_bytes(converted.get(converted.size() - 1));
      }
      v = converted;
    }
  }
  if (on_host) {
    record_cpu_fallback(base_name, host_in_bytes, host_out_bytes);
  }
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(as_strided));
  m.impl("view", TORCH_FN(view));
  m.impl("_reshape_alias", TORCH_FN(reshape_alias));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  m.impl("set_.source_Storage", TORCH_FN(set_source_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_source_storage_offset));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  m.impl("record_stream", TORCH_FN(record_stream));
  m.impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
}

// Structured ops (add, mul, mse_loss, ...) reach a PrivateUse1 device through
// a CompositeExplicitAutogradNonFunctional kernel that calls their out=
// variant. Sending the functional/in-place op itself to the fallback instead
// runs the CPU kernel as on CPU: eager signatures name the op the user ran
// (aten::add.Tensor, not aten::add.out), and CPU out= kernels' scratch
// resizes do not warn about a user-invisible output.
struct NonFunctionalOverride {
  NonFunctionalOverride() {
    auto& dispatcher = c10::Dispatcher::singleton();
    library_ = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1), __FILE__, __LINE__);
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      auto op = dispatcher.findOp(name);
      if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
          !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
          !op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
        continue;
      }
      std::string qualified = name.name.substr(6);
      if (!name.overload_name.empty()) {
        qualified += "." + name.overload_name;
      }
      library_->impl(
          qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
    }
  }
  std::unique_ptr<torch::Library> library_;
};

// Never freed: the registrations must outlive every op call during interpreter exit.
NonFunctionalOverride* g_non_functional_override = new NonFunctionalOverride();

TORCH_LIBRARY(neuron_sim, m) {
  m.def("cpu_alias(Tensor(a) self) -> Tensor(a)");
  m.def("hold(Tensor t) -> Tensor");
}

TORCH_LIBRARY_IMPL(neuron_sim, PrivateUse1, m) {
  m.impl("cpu_alias", TORCH_FN(cpu_alias_op));
}

TORCH_LIBRARY_IMPL(neuron_sim, CPU, m) {
  m.impl("hold", TORCH_FN(hold_op));
}

} // namespace nsim
