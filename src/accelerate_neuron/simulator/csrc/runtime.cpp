// Simulated Neuron runtime: PrivateUse1 allocator, device guard, hooks, RNG,
// and the C entry points the Python side reaches through ctypes.
//
// Device memory is host memory. That is what lets every CPU kernel run on a
// "neuron" tensor without a copy (see kernels.cpp) while the allocator still
// enforces a per-core HBM budget and keeps per-core statistics.

#include "sim.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace nsim {

DeviceMemory g_mem[kMaxDevices];
std::atomic<int> g_num_devices{0};
std::atomic<bool> g_initialized{false};
std::atomic<bool> g_bad_fork{false};
std::atomic<int64_t> g_h2d{0};
std::atomic<int64_t> g_d2h{0};
std::atomic<int64_t> g_d2d{0};
std::atomic<int64_t> g_eager_ops{0};
std::atomic<int64_t> g_fallback_calls{0};
std::atomic<int64_t> g_fallback_d2h{0};
std::atomic<int64_t> g_fallback_h2d{0};
thread_local int t_device = 0;
thread_local int t_suspend_counting = 0;

namespace {
std::mutex g_sig_mu;
std::unordered_set<std::string> g_signatures;
std::vector<std::string> g_signature_order;

std::mutex g_fallback_mu;
std::atomic<bool> g_has_fallback_ops{false};
std::unordered_set<std::string> g_fallback_ops;
// Per op, in first-seen order: how many times it ran on the host.
std::vector<std::pair<std::string, int64_t>> g_fallback_counts;
std::unordered_map<std::string, size_t> g_fallback_slot;

std::string human_bytes(int64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream os;
  os.precision(u == 0 ? 0 : 2);
  os << std::fixed << v << " " << units[u];
  return os.str();
}
} // namespace

void check_usable() {
  TORCH_CHECK(
      !g_bad_fork.load(),
      "Cannot use the Neuron runtime in a forked subprocess after it was "
      "initialised in the parent (simulated Neuron device). Start worker "
      "processes with the 'spawn' method.");
}

void mark_initialized() {
  check_usable();
  g_initialized.store(true);
}

void check_device_index(int index) {
  int n = g_num_devices.load();
  TORCH_CHECK(
      index >= 0 && index < n,
      "Invalid neuron device index ",
      index,
      ": this process sees ",
      n,
      " simulated Neuron core(s) (valid indices 0..",
      n - 1,
      "; NEURON_RT_VISIBLE_CORES selects which cores are visible).");
}

void record_signature(std::string sig) {
  g_eager_ops.fetch_add(1);
  std::lock_guard<std::mutex> lock(g_sig_mu);
  if (g_signatures.insert(sig).second) {
    g_signature_order.push_back(std::move(sig));
  }
}

bool is_cpu_fallback_op(const std::string& name) {
  if (!g_has_fallback_ops.load()) {
    return false;
  }
  std::lock_guard<std::mutex> lock(g_fallback_mu);
  return g_fallback_ops.count(name) > 0;
}

void record_cpu_fallback(const std::string& name, int64_t d2h, int64_t h2d) {
  g_fallback_calls.fetch_add(1);
  g_fallback_d2h.fetch_add(d2h);
  g_fallback_h2d.fetch_add(h2d);
  g_d2h.fetch_add(d2h);
  g_h2d.fetch_add(h2d);
  std::lock_guard<std::mutex> lock(g_fallback_mu);
  auto it = g_fallback_slot.find(name);
  if (it == g_fallback_slot.end()) {
    g_fallback_slot.emplace(name, g_fallback_counts.size());
    g_fallback_counts.emplace_back(name, 1);
  } else {
    g_fallback_counts[it->second].second += 1;
  }
}

// ---------------------------------------------------------------- allocator

namespace {

struct AllocationContext {
  void* ptr;
  size_t nbytes;
  int device;
};

void free_device_memory(void* raw) {
  auto* ctx = static_cast<AllocationContext*>(raw);
  g_mem[ctx->device].allocated.fetch_sub(static_cast<int64_t>(ctx->nbytes));
  g_mem[ctx->device].num_frees.fetch_add(1);
  std::free(ctx->ptr);
  delete ctx;
}

void update_peak(DeviceMemory& m, int64_t now) {
  int64_t peak = m.peak.load();
  while (now > peak && !m.peak.compare_exchange_weak(peak, now)) {
  }
}

} // namespace

struct NeuronAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const int device = t_device;
    check_device_index(device);
    mark_initialized();
    const c10::Device dev(c10::DeviceType::PrivateUse1, device);
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, dev);
    }
    DeviceMemory& m = g_mem[device];
    const int64_t want = static_cast<int64_t>(nbytes);
    const int64_t now = m.allocated.fetch_add(want) + want;
    const int64_t capacity = m.capacity.load();
    if (now > capacity) {
      m.allocated.fetch_sub(want);
      m.num_ooms.fetch_add(1);
      const int64_t in_use = now - want;
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          false,
          "Neuron out of memory (simulated device): tried to allocate ",
          human_bytes(want),
          " (",
          want,
          " bytes) on neuron:",
          device,
          " (core index ",
          device,
          "), which has ",
          human_bytes(capacity - in_use),
          " (",
          capacity - in_use,
          " bytes) free of ",
          human_bytes(capacity),
          " HBM; ",
          human_bytes(in_use),
          " allocated by PyTorch. Use a smaller batch or sequence length, or "
          "device_map=\"auto\" to spread the model over more cores.");
    }
    void* ptr = nullptr;
    // 64-byte alignment: CPU kernels vectorise on these buffers.
    const size_t rounded = (nbytes + 63) / 64 * 64;
    if (posix_memalign(&ptr, 64, rounded) != 0 || ptr == nullptr) {
      m.allocated.fetch_sub(want);
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          false,
          "host memory exhausted while simulating ",
          want,
          " bytes on neuron:",
          device);
    }
    update_peak(m, now);
    m.num_allocs.fetch_add(1);
    auto* ctx = new AllocationContext{ptr, nbytes, device};
    return c10::DataPtr(ptr, ctx, &free_device_memory, dev);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

NeuronAllocator g_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

c10::Allocator* device_allocator() {
  return &g_allocator;
}

// Pinned host memory: plain host memory that remembers it was pinned, so
// DataLoader(pin_memory=True) and `is_pinned()` behave as on an accelerator.
namespace {
std::mutex g_pinned_mu;
std::unordered_set<const void*> g_pinned;

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    g_pinned.erase(ptr);
  }
  std::free(ptr);
}
} // namespace

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
    }
    void* ptr = nullptr;
    const size_t rounded = (nbytes + 63) / 64 * 64;
    TORCH_CHECK(
        posix_memalign(&ptr, 64, rounded) == 0 && ptr != nullptr,
        "could not allocate ",
        nbytes,
        " bytes of pinned host memory");
    {
      std::lock_guard<std::mutex> lock(g_pinned_mu);
      g_pinned.insert(ptr);
    }
    return c10::DataPtr(ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedAllocator g_pinned_allocator;

bool is_pinned_ptr(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  return g_pinned.count(ptr) > 0;
}

// ---------------------------------------------------------------- RNG

// A per-core generator reporting device "neuron:i". Kernels run on the CPU, so
// the fallback hands them the CPU generator inside (see kernels.cpp).
struct NeuronGenerator final : public c10::GeneratorImpl {
  explicit NeuronGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(
            c10::Device(c10::DeviceType::PrivateUse1, index),
            c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(at::make_generator<at::CPUGeneratorImpl>(
            c10::default_rng_seed_val)) {}

  void set_current_seed(uint64_t seed) override {
    cpu_.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    cpu_.set_offset(offset);
  }
  uint64_t get_offset() const override {
    return cpu_.get_offset();
  }
  uint64_t current_seed() const override {
    return cpu_.current_seed();
  }
  uint64_t seed() override {
    return cpu_.seed();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    cpu_.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu_.unsafeGetGeneratorImpl()->get_state();
  }
  NeuronGenerator* clone_impl() const override {
    auto* gen = new NeuronGenerator(device().index());
    gen->cpu_ = cpu_.clone();
    return gen;
  }

  at::Generator cpu_;
};

namespace {
std::mutex g_gen_mu;
std::vector<at::Generator> g_default_generators(kMaxDevices);
} // namespace

const at::Generator& default_generator(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "bad neuron device ", device);
  std::lock_guard<std::mutex> lock(g_gen_mu);
  auto& gen = g_default_generators[device];
  if (!gen.defined()) {
    gen = at::make_generator<NeuronGenerator>(static_cast<c10::DeviceIndex>(device));
  }
  return gen;
}

at::Generator cpu_generator_for(const at::Generator& gen) {
  auto* impl = dynamic_cast<NeuronGenerator*>(gen.unsafeGetGeneratorImpl());
  return impl ? impl->cpu_ : gen;
}

// ---------------------------------------------------------------- guard

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType static_type = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override {
    return static_type;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (old.index() != d.index()) {
      setDevice(d);
    }
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(static_type, static_cast<c10::DeviceIndex>(t_device));
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.is_privateuseone(), "expected a neuron device, got ", d);
    if (d.index() >= 0) {
      check_device_index(d.index());
      t_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) {
      t_device = d.index();
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    (void)priority;
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool isHighPriority = false)
      const override {
    (void)isHighPriority;
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return s;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_num_devices.load());
  }
  // Work runs synchronously on the host, so every stream and event is
  // complete as soon as it is queried. Events keep a timestamp for
  // elapsed_time().
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<int64_t*>(event);
  }
  void record(
      void** event,
      const c10::Stream&,
      const c10::DeviceIndex,
      const c10::EventFlag) const override {
    auto now = std::chrono::steady_clock::now().time_since_epoch();
    int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now).count();
    if (*event == nullptr) {
      *event = new int64_t(ns);
    } else {
      *static_cast<int64_t*>(*event) = ns;
    }
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void* e1, void* e2, const c10::DeviceIndex) const override {
    TORCH_CHECK(e1 && e2, "both events must be recorded before elapsed_time()");
    return static_cast<double>(
               *static_cast<int64_t*>(e2) - *static_cast<int64_t*>(e1)) /
        1.0e6;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

// ---------------------------------------------------------------- hooks

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return g_num_devices.load() > 0;
  }
  const at::Generator& getDefaultGenerator(
      c10::DeviceIndex device_index) const override {
    int idx = device_index < 0 ? t_device : device_index;
    return default_generator(idx);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index = -1) const override {
    int idx = device_index < 0 ? t_device : device_index;
    return at::make_generator<NeuronGenerator>(static_cast<c10::DeviceIndex>(idx));
  }
  at::Device getDeviceFromPtr(void*) const override {
    return c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(t_device));
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &g_pinned_allocator;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return g_initialized.load();
  }
  void init() const override {
    mark_initialized();
  }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(g_num_devices.load());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    check_device_index(device);
    t_device = device;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return static_cast<c10::DeviceIndex>(t_device);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = static_cast<c10::DeviceIndex>(t_device);
    if (device >= 0) {
      check_device_index(device);
      t_device = device;
    }
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize)
      const override {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::PrivateUse1);
    const int old_device = t_device;
    t_device = storage.device().index();
    try {
      if (newsize == 0) {
        // resize_bytes_cpu would install a default (CPU) DataPtr: FSDP frees the unsharded
        // flat param with storage().resize_(0) and later set_()s it, which must stay on its core.
        TORCH_CHECK(storage.resizable(), "Trying to resize storage that is not resizable");
        storage.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(nullptr, storage.device()));
        storage.unsafeGetStorageImpl()->set_nbytes(0);
      } else {
        at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
      }
    } catch (...) {
      t_device = old_device;
      throw;
    }
    t_device = old_device;
  }
};

namespace {
struct HooksRegisterer {
  HooksRegisterer() {
    static NeuronHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
};
HooksRegisterer g_hooks_registerer;
} // namespace

// ------------------------------------------------ C entry points (ctypes)

extern "C" {

void nsim_configure(int num_devices, int64_t capacity_bytes) {
  if (num_devices > kMaxDevices) {
    num_devices = kMaxDevices;
  }
  g_num_devices.store(num_devices);
  for (int i = 0; i < kMaxDevices; ++i) {
    g_mem[i].capacity.store(capacity_bytes);
  }
  if (t_device >= num_devices) {
    t_device = 0;
  }
}

int nsim_num_devices() {
  return g_num_devices.load();
}

int nsim_is_initialized() {
  return g_initialized.load() ? 1 : 0;
}

void nsim_mark_initialized() {
  mark_initialized();
}

void nsim_mark_bad_fork() {
  if (g_initialized.load()) {
    g_bad_fork.store(true);
  }
}

int nsim_in_bad_fork() {
  return g_bad_fork.load() ? 1 : 0;
}

int nsim_current_device() {
  return t_device;
}

void nsim_set_device(int device) {
  t_device = device;
}

int64_t nsim_memory(int device, int which) {
  if (device < 0 || device >= kMaxDevices) {
    return 0;
  }
  DeviceMemory& m = g_mem[device];
  switch (which) {
    case 0:
      return m.allocated.load();
    case 1:
      return m.peak.load();
    case 2:
      return m.capacity.load();
    case 3:
      return m.num_allocs.load();
    case 4:
      return m.num_frees.load();
    case 5:
      return m.num_ooms.load();
    default:
      return 0;
  }
}

void nsim_reset_peak(int device) {
  if (device >= 0 && device < kMaxDevices) {
    g_mem[device].peak.store(g_mem[device].allocated.load());
  }
}

int64_t nsim_counter(int which) {
  switch (which) {
    case 0:
      return g_h2d.load();
    case 1:
      return g_d2h.load();
    case 2:
      return g_d2d.load();
    case 3:
      return g_eager_ops.load();
    case 4:
      return g_fallback_calls.load();
    case 5:
      return g_fallback_d2h.load();
    case 6:
      return g_fallback_h2d.load();
    default:
      return 0;
  }
}

// The ops that run on the host, newline-separated (replaces the previous set).
void nsim_set_cpu_fallback_ops(const char* spec) {
  std::lock_guard<std::mutex> lock(g_fallback_mu);
  g_fallback_ops.clear();
  std::istringstream in(spec == nullptr ? "" : spec);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) {
      g_fallback_ops.insert(line);
    }
  }
  g_has_fallback_ops.store(!g_fallback_ops.empty());
}

// Writes "op\tcount\n" per op that ran on the host (first-seen order); returns the size needed.
int64_t nsim_cpu_fallback_counts(char* buf, int64_t len) {
  std::lock_guard<std::mutex> lock(g_fallback_mu);
  std::string all;
  for (const auto& entry : g_fallback_counts) {
    all += entry.first + '\t' + std::to_string(entry.second) + '\n';
  }
  if (buf != nullptr && len >= static_cast<int64_t>(all.size())) {
    std::memcpy(buf, all.data(), all.size());
  }
  return static_cast<int64_t>(all.size());
}

// torch_neuronx.clear_op_tracking(): forget which ops ran on the host (the byte counters stay).
void nsim_clear_cpu_fallback_counts() {
  std::lock_guard<std::mutex> lock(g_fallback_mu);
  g_fallback_counts.clear();
  g_fallback_slot.clear();
}

int64_t nsim_signature_count() {
  std::lock_guard<std::mutex> lock(g_sig_mu);
  return static_cast<int64_t>(g_signature_order.size());
}

// Writes the signatures, newline-separated, into buf; returns the size needed.
int64_t nsim_signatures(char* buf, int64_t len) {
  std::lock_guard<std::mutex> lock(g_sig_mu);
  std::string all;
  for (const auto& s : g_signature_order) {
    all += s;
    all += '\n';
  }
  if (buf != nullptr && len >= static_cast<int64_t>(all.size())) {
    std::memcpy(buf, all.data(), all.size());
  }
  return static_cast<int64_t>(all.size());
}

void nsim_reset_stats() {
  g_h2d.store(0);
  g_d2h.store(0);
  g_d2d.store(0);
  g_eager_ops.store(0);
  g_fallback_calls.store(0);
  g_fallback_d2h.store(0);
  g_fallback_h2d.store(0);
  nsim_clear_cpu_fallback_counts();
  {
    std::lock_guard<std::mutex> lock(g_sig_mu);
    g_signatures.clear();
    g_signature_order.clear();
  }
  for (int i = 0; i < kMaxDevices; ++i) {
    g_mem[i].peak.store(g_mem[i].allocated.load());
    g_mem[i].num_ooms.store(0);
  }
}

void nsim_suspend_counting(int delta) {
  t_suspend_counting += delta;
}

void nsim_manual_seed(int device, uint64_t seed) {
  auto gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

uint64_t nsim_seed(int device) {
  auto gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.seed();
}

uint64_t nsim_initial_seed(int device) {
  auto gen = default_generator(device);
  return gen.current_seed();
}

// RNG state as bytes: returns the size; copies into buf when it is big enough.
int64_t nsim_get_rng_state(int device, uint8_t* buf, int64_t len) {
  auto gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto state = gen.get_state();
  const int64_t n = state.numel();
  if (buf != nullptr && len >= n) {
    std::memcpy(buf, state.data_ptr(), n);
  }
  return n;
}

void nsim_set_rng_state(int device, const uint8_t* buf, int64_t len) {
  auto gen = default_generator(device);
  auto state = at::empty({len}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(state.data_ptr(), buf, len);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

} // extern "C"

} // namespace nsim
