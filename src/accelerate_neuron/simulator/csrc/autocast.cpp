// Autocast for the simulated Neuron device.
//
// Without a registration for AutocastPrivateUse1 every op under
// torch.autocast("neuron") fails with "Could not run ... 'Autocastneuron'".
// This applies the cast policy PyTorch uses for CUDA/XPU (matmuls in the
// autocast dtype, norms/reductions/losses in fp32, mixed inputs promoted),
// with the op lists taken from the installed PyTorch's ATen/autocast_mode.h
// at build time (policy_table.inc). It is a boxed kernel rather than
// PyTorch's templated wrappers so the simulator builds in seconds; it does not
// keep autocast's weight-cast cache.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>

namespace at::autocast {
TORCH_API at::ScalarType get_autocast_dtype(at::DeviceType device_type);
} // namespace at::autocast

namespace nsim {
namespace {

enum class Policy { kLower, kFp32, kFp32SetOptDtype, kPromote };

struct PolicyEntry {
  const char* name;
  const char* overload;
  Policy policy;
};

const PolicyEntry kPolicies[] = {
#include "policy_table.inc"
};

const std::unordered_map<std::string, Policy>& policy_map() {
  static const std::unordered_map<std::string, Policy> map = [] {
    std::unordered_map<std::string, Policy> m;
    for (const auto& e : kPolicies) {
      std::string key = std::string("aten::") + e.name;
      if (e.overload[0] != '\0') {
        key += ".";
        key += e.overload;
      }
      m.emplace(std::move(key), e.policy);
    }
    return m;
  }();
  return map;
}

bool eligible(const at::Tensor& t) {
  return t.defined() && t.is_privateuseone() && t.is_floating_point() &&
      t.scalar_type() != at::kDouble;
}

c10::IValue cast_value(const c10::IValue& v, at::ScalarType to) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return eligible(t) && t.scalar_type() != to ? c10::IValue(t.to(to)) : v;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) {
      out.push_back(eligible(t) && t.scalar_type() != to ? t.to(to) : t);
    }
    return out;
  }
  return v;
}

void autocast_kernel(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& map = policy_map();
  std::string key = schema.operator_name().name;
  if (!schema.overload_name().empty()) {
    key += "." + schema.overload_name();
  }
  auto it = map.find(key);
  if (it == map.end()) {
    // Not a policy op: run it below autocast, so the ops it decomposes into
    // still meet the policy (as PyTorch's fallthrough does).
    op.redispatchBoxed(
        keys & c10::DispatchKeySet(
                   c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::AutocastPrivateUse1),
        stack);
    return;
  }
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastPrivateUse1);
    const size_t n = schema.arguments().size();
    const size_t begin = stack->size() - n;
    const at::ScalarType lower = at::autocast::get_autocast_dtype(c10::DeviceType::PrivateUse1);
    switch (it->second) {
      case Policy::kLower:
      case Policy::kFp32: {
        const at::ScalarType to = it->second == Policy::kLower ? lower : at::kFloat;
        for (size_t i = begin; i < stack->size(); ++i) {
          (*stack)[i] = cast_value((*stack)[i], to);
        }
        break;
      }
      case Policy::kPromote: {
        at::ScalarType to = lower;
        for (size_t i = begin; i < stack->size(); ++i) {
          const c10::IValue& v = (*stack)[i];
          if (v.isTensor() && eligible(v.toTensor())) {
            to = c10::promoteTypes(to, v.toTensor().scalar_type());
          }
        }
        for (size_t i = begin; i < stack->size(); ++i) {
          (*stack)[i] = cast_value((*stack)[i], to);
        }
        break;
      }
      case Policy::kFp32SetOptDtype: {
        bool first_eligible = false;
        for (size_t i = begin; i < stack->size(); ++i) {
          const c10::IValue& v = (*stack)[i];
          if (v.isTensor()) {
            first_eligible = eligible(v.toTensor());
            break;
          }
        }
        if (first_eligible) {
          const auto& args = schema.arguments();
          for (size_t i = 0; i < n; ++i) {
            if (args[i].name() == "dtype" && (*stack)[begin + i].isNone()) {
              (*stack)[begin + i] = static_cast<int64_t>(at::kFloat);
            }
          }
        }
        break;
      }
    }
    op.callBoxed(stack);
  }
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&autocast_kernel>());
}

} // namespace
} // namespace nsim
