// Shared state of the simulated Neuron device (see runtime.cpp, kernels.cpp).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace nsim {

constexpr int kMaxDevices = 128;

struct DeviceMemory {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> capacity{int64_t(24) << 30};
  std::atomic<int64_t> num_allocs{0};
  std::atomic<int64_t> num_frees{0};
  std::atomic<int64_t> num_ooms{0};
};

extern DeviceMemory g_mem[kMaxDevices];
extern std::atomic<int> g_num_devices;
extern std::atomic<bool> g_initialized;
extern std::atomic<int64_t> g_h2d;
extern std::atomic<int64_t> g_d2h;
extern std::atomic<int64_t> g_d2d;
extern thread_local int t_device;
// > 0 while a graph compiled by the "neuron" torch.compile backend runs: its
// ops belong to one compiled graph, not to Neuron's op-by-op eager mode.
extern thread_local int t_suspend_counting;

void check_usable();
void mark_initialized();
void check_device_index(int index);
void record_signature(std::string sig);
// Ops the real backend runs on the host (its CPU_FALLBACK list, as configured from Python).
bool is_cpu_fallback_op(const std::string& name);
// One host round trip of `name`: `d2h` bytes of device inputs copied out, `h2d` bytes of results back.
void record_cpu_fallback(const std::string& name, int64_t d2h, int64_t h2d);
c10::Allocator* device_allocator();
const at::Generator& default_generator(int device);
at::Generator cpu_generator_for(const at::Generator& gen);

} // namespace nsim
