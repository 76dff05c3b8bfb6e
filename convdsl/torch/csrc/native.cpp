// convdsl.torch's planned convolutions in C++: the launches of a call and its autograd node, so that an eager
// training step spends no Python between a module's forward and its kernels' launches, nor any in backward; and
// the operators' CUDA kernels, so that torch.compile's graphs call a planned convolution without Python either.
//
// What a call launches is decided in Python, once per signature (convdsl/torch/native.py builds a Program from a
// stream kernel: which buffers to allocate, which kernels to launch on which buffers, which TMA descriptors to
// encode); here it is only carried out.  The kernels are launched through the CUDA driver (looked up in
// libcuda.so.1 at run time) on PyTorch's current stream, with PyTorch's caching allocator for every buffer,
// exactly as convdsl/torch/stream.py does in Python.
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>

#include <torch/library.h>

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// The driver entry points, from libcuda.so.1 itself: nothing to link, as convdsl/backends/cuda_driver.py.
struct Driver {
  decltype(&cuLaunchKernel) launch = nullptr;
  decltype(&cuTensorMapEncodeTiled) encode_tiled = nullptr;
  decltype(&cuTensorMapEncodeIm2col) encode_im2col = nullptr;
  decltype(&cuGetErrorName) error_name = nullptr;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDevicePrimaryCtxRetain) primary_context = nullptr;
  decltype(&cuCtxSetCurrent) set_context = nullptr;
};

template <typename F>
F symbol(void* library, const char* name) {
  void* found = dlsym(library, name);
  TORCH_CHECK(found != nullptr, "convdsl: the CUDA driver has no ", name);
  return reinterpret_cast<F>(found);
}

const Driver& driver() {
  static const Driver loaded = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(library != nullptr, "convdsl: the CUDA driver (libcuda.so.1) could not be loaded");
    Driver d;
    d.launch = symbol<decltype(d.launch)>(library, "cuLaunchKernel");
    d.encode_tiled = symbol<decltype(d.encode_tiled)>(library, "cuTensorMapEncodeTiled");
    d.encode_im2col = symbol<decltype(d.encode_im2col)>(library, "cuTensorMapEncodeIm2col");
    d.error_name = symbol<decltype(d.error_name)>(library, "cuGetErrorName");
    d.device_get = symbol<decltype(d.device_get)>(library, "cuDeviceGet");
    d.primary_context = symbol<decltype(d.primary_context)>(library, "cuDevicePrimaryCtxRetain");
    d.set_context = symbol<decltype(d.set_context)>(library, "cuCtxSetCurrent");
    return d;
  }();
  return loaded;
}

void check(CUresult status, const char* call, const std::string& what) {
  if (status != CUDA_SUCCESS) {
    const char* name = nullptr;
    driver().error_name(status, &name);
    TORCH_CHECK(false, call, "(", what, ") failed: ", name != nullptr ? name : std::to_string(status));
  }
}

// The current device's primary context (PyTorch's) made current on this thread: autograd's device threads have
// none until the runtime API binds one, which a backward whose first launch is ours has not done yet.
void bind_primary_context() {
  CUdevice device;
  CUcontext context;
  check(driver().device_get(&device, c10::cuda::current_device()), "cuDeviceGet", "the current device");
  check(driver().primary_context(&context, device), "cuDevicePrimaryCtxRetain", "the current device");
  check(driver().set_context(context), "cuCtxSetCurrent", "the current device");
}

// A TMA descriptor over one buffer of the call, encoded per call (a few hundred nanoseconds): its arguments are
// the driver's, worked out in Python (innermost dimension first).
struct TensorMapSpec {
  int slot = 0;
  bool im2col = false;
  int type = 0;
  std::vector<cuuint64_t> dims, strides;
  std::vector<cuuint32_t> box, element_strides;
  std::vector<int> lower, upper;
  cuuint32_t channels = 0, pixels = 0;
  int swizzle = 0;

  void encode(CUtensorMap* map, void* address) const {
    const auto data_type = static_cast<CUtensorMapDataType>(type);
    const auto rank = static_cast<cuuint32_t>(dims.size());
    const auto swizzled = static_cast<CUtensorMapSwizzle>(swizzle);
    CUresult status = im2col
        ? driver().encode_im2col(map, data_type, rank, address, dims.data(), strides.data(), lower.data(),
                                 upper.data(), channels, pixels, element_strides.data(),
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, swizzled, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        : driver().encode_tiled(map, data_type, rank, address, dims.data(), strides.data(), box.data(),
                                element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, swizzled,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    check(status, im2col ? "cuTensorMapEncodeIm2col" : "cuTensorMapEncodeTiled", "a convdsl kernel's operand");
  }
};

constexpr int kPointer = 0;  // a parameter: the device address of one of the call's buffers
constexpr int kMap = 1;      // a parameter: one of the launch's TMA descriptors, by value
constexpr int kZero = 2;     // a parameter the kernel does not read (Triton's scratch pointers)
constexpr int kMaxParams = 64;
constexpr int kMaxMaps = 4;

struct Launch {
  CUfunction function = nullptr;
  std::array<unsigned, 3> grid{1, 1, 1};
  unsigned threads = 0, shared_bytes = 0;
  std::string name;
  std::vector<std::pair<int, int>> params;  // (kind, buffer slot or map index)
  std::vector<TensorMapSpec> maps;

  Launch() = default;
  Launch(uint64_t function, std::array<unsigned, 3> grid, unsigned threads, unsigned shared_bytes, std::string name,
         std::vector<std::pair<int, int>> params, std::vector<TensorMapSpec> maps)
      : function(reinterpret_cast<CUfunction>(function)), grid(grid), threads(threads), shared_bytes(shared_bytes),
        name(std::move(name)), params(std::move(params)), maps(std::move(maps)) {}

  void run(CUstream stream, const std::vector<at::Tensor>& buffers) const {
    alignas(64) CUtensorMap descriptors[kMaxMaps];
    std::array<uint64_t, kMaxParams> values{};
    std::array<void*, kMaxParams> args{};
    for (size_t i = 0; i < maps.size(); ++i) {
      maps[i].encode(&descriptors[i], buffers[maps[i].slot].data_ptr());
    }
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [kind, index] = params[i];
      if (kind == kMap) {
        args[i] = &descriptors[index];
        continue;
      }
      values[i] = kind == kPointer ? reinterpret_cast<uint64_t>(buffers[index].data_ptr()) : 0;
      args[i] = &values[i];
    }
    auto launch = [&] {
      return driver().launch(function, grid[0], grid[1], grid[2], threads, 1, 1, shared_bytes, stream, args.data(),
                             nullptr);
    };
    CUresult status = launch();
    if (status == CUDA_ERROR_INVALID_CONTEXT) {
      bind_primary_context();
      status = launch();
    }
    check(status, "cuLaunchKernel", name);
  }
};

at::ScalarType scalar_type(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float64") return at::kDouble;
  if (name == "float8_e4m3fn") return at::kFloat8_e4m3fn;
  if (name == "float8_e5m2") return at::kFloat8_e5m2;
  TORCH_CHECK(false, "convdsl: expected a float dtype name, got ", name);
}

at::MemoryFormat memory_format(int code) {
  switch (code) {
    case 0: return at::MemoryFormat::Contiguous;
    case 1: return at::MemoryFormat::ChannelsLast;
    case 2: return at::MemoryFormat::ChannelsLast3d;
  }
  TORCH_CHECK(false, "convdsl: expected a memory format code 0, 1 or 2, got ", code);
}

constexpr int64_t kAlignment = 16;  // every binding of the kernels starts 16-byte aligned

at::Tensor aligned(const at::Tensor& t) {
  // an offset view: a copy in the same memory format (clone keeps the strides of a dense tensor)
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignment == 0 ? t : t.clone();
}

// One call's work on its two arguments (buffers 0 and 1): the result (buffer 2, allocated in PyTorch's memory
// format), then each step in order.
struct Program {
  enum StepKind { kAlloc = 0, kCopy = 1, kLaunch = 2 };
  struct Step {
    StepKind kind;
    int dst = 0, src = 0, launch = 0;
    std::vector<int64_t> shape, strides;
    at::ScalarType dtype = at::kFloat;
  };

  std::vector<int64_t> result_shape;
  at::MemoryFormat result_format = at::MemoryFormat::Contiguous;
  at::ScalarType result_dtype = at::kFloat;
  std::vector<Step> steps;
  std::vector<Launch> launches;
  int buffers = 3;

  Program(std::vector<int64_t> shape, int format, const std::string& dtype)
      : result_shape(std::move(shape)), result_format(memory_format(format)), result_dtype(scalar_type(dtype)) {}

  int alloc(std::vector<int64_t> shape, const std::string& dtype) {
    steps.push_back({kAlloc, buffers, 0, 0, std::move(shape), {}, scalar_type(dtype)});
    return buffers++;
  }

  // src's elements at (shape, strides) from where it starts (a permuted view of it), copied contiguous
  int copy(int src, std::vector<int64_t> shape, std::vector<int64_t> strides) {
    steps.push_back({kCopy, buffers, src, 0, std::move(shape), std::move(strides), at::kFloat});
    return buffers++;
  }

  void launch(uint64_t function, std::array<unsigned, 3> grid, unsigned threads, unsigned shared_bytes,
              std::string name, std::vector<std::pair<int, int>> params, std::vector<TensorMapSpec> maps) {
    TORCH_CHECK(params.size() <= kMaxParams && maps.size() <= kMaxMaps, "convdsl: launch ", name, " has ",
                params.size(), " parameters and ", maps.size(), " maps; expected at most ", kMaxParams, " and ",
                kMaxMaps);
    for (const auto& [kind, index] : params) {
      TORCH_CHECK(kind != kPointer || index < buffers, "convdsl: launch ", name, " reads buffer ", index,
                  " before it exists");
    }
    steps.push_back({kLaunch, 0, 0, static_cast<int>(launches.size()), {}, {}, at::kFloat});
    launches.emplace_back(function, grid, threads, shared_bytes, std::move(name), std::move(params),
                          std::move(maps));
  }

  at::Tensor run(const at::Tensor& a, const at::Tensor& b) const {
    std::vector<at::Tensor> t(buffers);
    t[0] = aligned(a);
    t[1] = aligned(b);
    const auto options = a.options();
    t[2] = at::empty(result_shape, options.dtype(result_dtype).memory_format(result_format));
    const auto stream = reinterpret_cast<CUstream>(c10::cuda::getCurrentCUDAStream(a.get_device()).stream());
    for (const Step& s : steps) {
      switch (s.kind) {
        case kAlloc: t[s.dst] = at::empty(s.shape, options.dtype(s.dtype)); break;
        case kCopy:
          t[s.dst] = t[s.src].as_strided(s.shape, s.strides, t[s.src].storage_offset()).contiguous();
          break;
        case kLaunch: launches[s.launch].run(stream, t); break;
      }
    }
    return t[2];
  }
};

// One convolution module's calls for one signature (ops.py's _Plan): the forward's program and the gradients'
// (null where none was planned: Python computes that gradient, as it does a double backward).
struct ConvPlan {
  std::shared_ptr<Program> forward, grad_input, grad_weight;
  at::ScalarType compute_dtype, weight_dtype;
  at::MemoryFormat dy_format;  // dY is taken in the forward result's format (ops.like_forward)
  std::vector<int64_t> bias_shape, bias_dims;
  // (x, w, parameter, dy, (needs dx, dw, db)) -> (dx, dw, db): the Python gradients
  py::object python_gradients;

  ConvPlan(std::shared_ptr<Program> forward, std::shared_ptr<Program> grad_input,
           std::shared_ptr<Program> grad_weight, const std::string& compute, const std::string& weight,
           int dy_format, int dims, py::object python_gradients)
      : forward(std::move(forward)), grad_input(std::move(grad_input)), grad_weight(std::move(grad_weight)),
        compute_dtype(scalar_type(compute)), weight_dtype(scalar_type(weight)), dy_format(memory_format(dy_format)),
        python_gradients(std::move(python_gradients)) {
    bias_shape = {1, -1};
    bias_dims = {0};
    for (int d = 0; d < dims; ++d) {
      bias_shape.push_back(1);
      bias_dims.push_back(d + 2);
    }
  }

  ~ConvPlan() {
    // the last owner may be an autograd node freed on PyTorch's backward thread, without the GIL
    if (python_gradients && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      python_gradients = py::object();
    } else {
      python_gradients.release();
    }
  }
};

// How autograd holds its nodes: std::shared_ptr before PyTorch 2.12, c10::intrusive_ptr since.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

struct ConvolutionBackward : public Node {
  std::shared_ptr<ConvPlan> plan;
  SavedVariable x_, w_, parameter_;
  bool has_bias = false;

  std::string name() const override { return "ConvdslConvolutionBackward"; }

  void release_variables() override {
    x_.reset_data();
    w_.reset_data();
    parameter_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(3);
    at::Tensor dy = grads[0];
    if (!dy.defined()) return out;
    const bool needs[3] = {should_compute_output(0), should_compute_output(1), has_bias && should_compute_output(2)};
    at::Tensor x = x_.unpack(), w = w_.unpack(), parameter = parameter_.unpack();
    // a double backward (create_graph: grad mode on here), or a gradient no kernel was planned for: Python's
    if (at::GradMode::is_enabled() || (needs[0] && !plan->grad_input) || (needs[1] && !plan->grad_weight)) {
      py::gil_scoped_acquire gil;
      try {
        py::tuple result = plan->python_gradients(x, w, parameter, dy, py::make_tuple(needs[0], needs[1], needs[2]));
        for (int i = 0; i < 3; ++i) {
          if (!result[i].is_none()) out[i] = result[i].cast<at::Tensor>();
        }
      } catch (py::error_already_set& e) {
        throw std::runtime_error(e.what());
      }
      return out;
    }
    dy = dy.contiguous(plan->dy_format);
    if (needs[0]) out[0] = plan->grad_input->run(dy, w);
    if (needs[1]) {
      // under autocast the kernels sum their f32 partials straight into the f32 parameter's gradient
      at::Tensor dw = plan->grad_weight->run(x, dy);
      out[1] = dw.scalar_type() == plan->weight_dtype ? dw : dw.to(plan->weight_dtype);
    }
    if (needs[2]) out[2] = dy.sum(plan->bias_dims);
    return out;
  }
};

// y = conv(x, w) + bias by the plan, recorded for autograd as one node.  Under autocast w is the parameter (f32,
// say): cast here, where autograd does not record it, and its gradient cast back in backward.
at::Tensor convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       const std::shared_ptr<ConvPlan>& plan) {
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  at::Tensor y, compute_w;
  {
    at::AutoGradMode no_grad(false);
    c10::cuda::CUDAGuard device(x.device());
    compute_w = w.scalar_type() == plan->compute_dtype ? w : w.to(plan->compute_dtype);
    y = plan->forward->run(x, compute_w);
    if (b.defined()) y.add_(b.view(plan->bias_shape).to(y.scalar_type()));
  }
  if (at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || (b.defined() && b.requires_grad()))) {
    auto node = make_node<ConvolutionBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, w, b));
    node->plan = plan;
    node->x_ = SavedVariable(x, false);
    node->w_ = SavedVariable(compute_w, false);
    node->parameter_ = SavedVariable(w, false);
    node->has_bias = b.defined();
    torch::autograd::set_history(y, NodePtr(node));
  }
  return y;
}

at::Tensor run_program(const Program& program, const at::Tensor& a, const at::Tensor& b) {
  c10::cuda::CUDAGuard device(a.device());
  return program.run(a, b);
}

// --- the fused BatchNorm + activation (fused.py) ---------------------------------------------------------------
// BatchNormActivation's four launches and its autograd node in C++: a fused layer's forward and backward spend no
// Python beyond finding the plan.  The launches and the order of their buffers are fused.py's (kernels/batchnorm.py
// has the kernels): what Python decided once per signature is carried out here.

enum BatchNormLaunch { kStats = 0, kApply = 1, kGradStats = 2, kGradApply = 3 };

struct BatchNormPlan {
  std::array<Launch, 4> launches;
  int64_t work_elements = 0, channels = 0;
  bool residual = false;

  BatchNormPlan(int64_t work_elements, int64_t channels, bool residual)
      : work_elements(work_elements), channels(channels), residual(residual) {}

  void set(int which, uint64_t function, std::array<unsigned, 3> grid, unsigned threads, unsigned shared_bytes,
           std::string name, std::vector<std::pair<int, int>> params) {
    TORCH_CHECK(which >= 0 && which < 4 && params.size() <= kMaxParams, "convdsl: fused BatchNorm launch ", name,
                ": expected one of 4 launches with at most ", kMaxParams, " parameters");
    launches[which] = Launch(function, grid, threads, shared_bytes, std::move(name), std::move(params), {});
  }
};

CUstream current_stream(const at::Tensor& t) {
  return reinterpret_cast<CUstream>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
}

// y as the kernels read it: y's own strides (the plan's), 16-byte aligned
at::Tensor like_planned(const at::Tensor& t, const at::Tensor& y) {
  if (t.strides() == y.strides() && reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignment == 0) return t;
  at::Tensor copy = at::empty_strided(y.sizes(), y.strides(), t.options());
  copy.copy_(t);
  return copy;
}

// A node's owning pointer to itself (what SavedVariable::unpack takes for an output the node saved)
template <typename P = NodePtr, typename N>
P self_pointer(N* node) {
  if constexpr (std::is_same_v<P, std::shared_ptr<Node>>) {
    return node->shared_from_this();
  } else {
    return P::unsafe_reclaim_from_nonowning(node);
  }
}

struct BatchNormActivationBackward : public Node {
  std::shared_ptr<BatchNormPlan> plan;
  SavedVariable y_, stats_, weight_, bias_, out_;
  at::Tensor counter;  // the stream's tickets (fused.py's _counter): zero between calls
  at::ScalarType weight_dtype = at::kFloat, bias_dtype = at::kFloat;

  std::string name() const override { return "ConvdslBatchNormActivationBackward"; }

  void release_variables() override {
    y_.reset_data();
    stats_.reset_data();
    weight_.reset_data();
    bias_.reset_data();
    out_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    // fused.py's once_differentiable: its kernels are not differentiable, so a double backward raises
    TORCH_CHECK(!at::GradMode::is_enabled(), "convdsl: the fused BatchNorm's backward is not differentiable ",
                "(a gradient of its gradient, create_graph=True); use torch.nn's BatchNorm for that");
    variable_list out(4);
    at::Tensor dout = grads[0];
    if (!dout.defined()) return out;
    at::Tensor y = y_.unpack(), stats = stats_.unpack(), weight = weight_.unpack(), bias = bias_.unpack();
    // with a residual the activation's mask is the output's; a saved output keeps no reference to its node (no
    // cycle), so unpacking it names the node
    at::Tensor kept = plan->residual ? out_.unpack(self_pointer(this)) : y;
    c10::cuda::CUDAGuard device(y.device());
    dout = like_planned(dout, y);
    const auto f32 = y.options().dtype(at::kFloat);
    at::Tensor work = at::empty({plan->work_elements}, f32);
    at::Tensor sums = at::empty({2 * plan->channels}, f32);  // dbeta, dgamma
    const CUstream stream = current_stream(y);
    plan->launches[kGradStats].run(stream, {dout, y, stats, weight, bias, kept, work, counter, sums});
    at::Tensor dy = at::empty_like(y);
    at::Tensor dres = plan->residual ? at::empty_like(y) : y;
    plan->launches[kGradApply].run(stream, {dout, y, stats, weight, bias, kept, sums, dy, dres});
    out[0] = dy;
    if (should_compute_output(1)) {
      at::Tensor dgamma = sums.narrow(0, plan->channels, plan->channels);
      out[1] = weight_dtype == at::kFloat ? dgamma : dgamma.to(weight_dtype);
    }
    if (should_compute_output(2)) {
      at::Tensor dbeta = sums.narrow(0, 0, plan->channels);
      out[2] = bias_dtype == at::kFloat ? dbeta : dbeta.to(bias_dtype);
    }
    if (plan->residual && should_compute_output(3)) out[3] = dres;
    return out;
  }
};

// out = act(batch_norm(y) (+ residual)) in training mode, the running statistics updated in place by the kernels
// (running_mean undefined: not tracked); batches: num_batches_tracked (read where momentum is None).  y,
// residual, weight and bias come as the plan was made for (fused.py checks strides and alignment).
at::Tensor batch_norm_activation(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                                 const std::optional<at::Tensor>& residual,
                                 const std::optional<at::Tensor>& running_mean,
                                 const std::optional<at::Tensor>& running_var,
                                 const std::optional<at::Tensor>& batches, const at::Tensor& counter,
                                 const std::shared_ptr<BatchNormPlan>& plan) {
  c10::cuda::CUDAGuard device(y.device());
  at::Tensor work, out;
  {
    at::AutoGradMode no_grad(false);
    work = at::empty({plan->work_elements}, y.options().dtype(at::kFloat));  // the statistics, then partials
    const bool update = running_mean.has_value() && running_mean->defined();
    const bool counted = batches.has_value() && batches->defined();
    const CUstream stream = current_stream(y);
    plan->launches[kStats].run(stream, {y, work, counter, update ? *running_mean : work,
                                        update ? *running_var : work, counted ? *batches : work});
    out = at::empty_like(y);
    const at::Tensor res = residual.has_value() && residual->defined() ? *residual : y;
    plan->launches[kApply].run(stream, {y, work, weight, bias, res, out});
  }
  const at::Tensor res = residual.has_value() ? *residual : at::Tensor();
  if (at::GradMode::is_enabled() &&
      (y.requires_grad() || weight.requires_grad() || bias.requires_grad() || (res.defined() && res.requires_grad()))) {
    auto node = make_node<BatchNormActivationBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(y, weight, bias, res));
    node->plan = plan;
    node->y_ = SavedVariable(y, false);
    node->stats_ = SavedVariable(work, false);
    node->weight_ = SavedVariable(weight, false);
    node->bias_ = SavedVariable(bias, false);
    node->counter = counter;
    node->weight_dtype = weight.scalar_type();
    node->bias_dtype = bias.scalar_type();
    torch::autograd::set_history(out, NodePtr(node));
    if (plan->residual) node->out_ = SavedVariable(out, true);  // the node's own output: saved once it has it
  }
  return out;
}

// --- the operators' CUDA kernels ----------------------------------------------------------------------------
// ops.py's torch.library operators (what torch.compile's graphs and the general path call) find the program of a
// call here, by its signature, and run it without Python; a signature not seen planned yet goes to the Python
// kernel (runtime.run), which plans it and, from its second call, hands its program here (remember).

enum OperatorKind { kForwardOp = 0, kGradInputOp = 1, kGradWeightOp = 2 };

// runtime._key's fields: op, both arguments' shapes and strides, dtypes and device, the problem's sizes and
// parameters, and whether TF32 is allowed (f32 calls plan tf32 compute then)
struct OperatorKey {
  std::vector<int64_t> ints;
  bool operator==(const OperatorKey& other) const { return ints == other.ints; }
};

struct OperatorKeyHash {
  size_t operator()(const OperatorKey& k) const {
    size_t h = k.ints.size();
    for (int64_t v : k.ints) h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

void append(std::vector<int64_t>& ints, c10::IntArrayRef values) {
  ints.push_back(static_cast<int64_t>(values.size()));
  ints.insert(ints.end(), values.begin(), values.end());
}

OperatorKey operator_key(int op, const at::Tensor& a, const at::Tensor& b, c10::IntArrayRef spatial,
                         c10::IntArrayRef filt, c10::IntArrayRef stride, c10::IntArrayRef pad_lo,
                         c10::IntArrayRef pad_hi, c10::IntArrayRef dilation, int64_t groups) {
  OperatorKey k;
  k.ints.reserve(64);
  k.ints.push_back(op);
  append(k.ints, a.sizes());
  append(k.ints, a.strides());
  append(k.ints, b.sizes());
  append(k.ints, b.strides());
  k.ints.push_back(static_cast<int64_t>(a.scalar_type()));
  k.ints.push_back(static_cast<int64_t>(b.scalar_type()));
  k.ints.push_back(a.get_device());
  for (auto values : {spatial, filt, stride, pad_lo, pad_hi, dilation}) append(k.ints, values);
  k.ints.push_back(groups);
  k.ints.push_back(at::globalContext().allowTF32CuDNN());
  return k;
}

struct Operators {
  std::mutex lock;  // the forward runs on the caller's thread, a compiled backward on autograd's
  std::unordered_map<OperatorKey, std::shared_ptr<Program>, OperatorKeyHash> programs;
  py::object python[3];  // ops.py's Python kernels, for the signatures not here
  std::unique_ptr<torch::Library> library;

  std::shared_ptr<Program> find(const OperatorKey& key) {
    std::lock_guard<std::mutex> guard(lock);
    auto found = programs.find(key);
    return found == programs.end() ? nullptr : found->second;
  }
};

Operators& operators() {
  static Operators* all = new Operators();  // never destroyed: its Python objects outlive the interpreter's exit
  return *all;
}

std::vector<int64_t> ints(c10::IntArrayRef values) { return std::vector<int64_t>(values.begin(), values.end()); }

template <typename... Args>
at::Tensor python_kernel(int op, Args&&... args) {
  py::gil_scoped_acquire gil;
  // a Python error keeps its type (torch.nn's RuntimeError, ValueError) on its way back to the caller
  return operators().python[op](std::forward<Args>(args)...).template cast<at::Tensor>();
}

at::Tensor forward_operator(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                            c10::IntArrayRef stride, c10::IntArrayRef pad_lo, c10::IntArrayRef pad_hi,
                            c10::IntArrayRef dilation, int64_t groups) {
  const auto program = operators().find(operator_key(kForwardOp, x, w, x.sizes().slice(2), w.sizes().slice(2),
                                                     stride, pad_lo, pad_hi, dilation, groups));
  if (!program) {
    return python_kernel(kForwardOp, x, w, bias, ints(stride), ints(pad_lo), ints(pad_hi), ints(dilation), groups);
  }
  c10::cuda::CUDAGuard device(x.device());
  at::Tensor y = program->run(x, w);
  if (bias.has_value() && bias->defined()) {
    std::vector<int64_t> shape(y.dim(), 1);
    shape[1] = -1;
    y.add_(bias->view(shape).to(y.scalar_type()));
  }
  return y;
}

at::Tensor grad_input_operator(const at::Tensor& dy, const at::Tensor& w, c10::IntArrayRef input_size,
                               c10::IntArrayRef stride, c10::IntArrayRef pad_lo, c10::IntArrayRef pad_hi,
                               c10::IntArrayRef dilation, int64_t groups) {
  const auto program = operators().find(operator_key(kGradInputOp, dy, w, input_size.slice(2), w.sizes().slice(2),
                                                     stride, pad_lo, pad_hi, dilation, groups));
  if (!program) {
    return python_kernel(kGradInputOp, dy, w, ints(input_size), ints(stride), ints(pad_lo), ints(pad_hi),
                         ints(dilation), groups);
  }
  c10::cuda::CUDAGuard device(dy.device());
  return program->run(dy, w);
}

at::Tensor grad_weight_operator(const at::Tensor& x, const at::Tensor& dy, c10::IntArrayRef weight_size,
                                c10::IntArrayRef stride, c10::IntArrayRef pad_lo, c10::IntArrayRef pad_hi,
                                c10::IntArrayRef dilation, int64_t groups) {
  const auto program = operators().find(operator_key(kGradWeightOp, x, dy, x.sizes().slice(2),
                                                     weight_size.slice(2), stride, pad_lo, pad_hi, dilation, groups));
  if (!program) {
    return python_kernel(kGradWeightOp, x, dy, ints(weight_size), ints(stride), ints(pad_lo), ints(pad_hi),
                         ints(dilation), groups);
  }
  c10::cuda::CUDAGuard device(x.device());
  return program->run(x, dy);
}

// The operators' CUDA kernels become these (ops.py has removed its Python ones first); `python`: its Python
// kernels (forward, grad_input, grad_weight), called for signatures without a program.
void take_operators(const std::string& ns, py::object forward, py::object grad_input, py::object grad_weight) {
  Operators& all = operators();
  TORCH_CHECK(!all.library, "convdsl: the operators' CUDA kernels are already the native ones");
  all.python[kForwardOp] = std::move(forward);
  all.python[kGradInputOp] = std::move(grad_input);
  all.python[kGradWeightOp] = std::move(grad_weight);
  all.library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CUDA, __FILE__,
                                                 __LINE__);
  // each with its twin for Inductor's graphs (ops.py's GRAPH_TWINS: no autograd or autocast kernel)
  all.library->impl("convolution", &forward_operator);
  all.library->impl("graph_convolution", &forward_operator);
  all.library->impl("convolution_grad_input", &grad_input_operator);
  all.library->impl("graph_convolution_grad_input", &grad_input_operator);
  all.library->impl("convolution_grad_weight", &grad_weight_operator);
  all.library->impl("graph_convolution_grad_weight", &grad_weight_operator);
}

// A planned call's program (runtime.run, from its second call), for the operator calls of its signature.
void remember(int op, const at::Tensor& a, const at::Tensor& b, std::vector<int64_t> spatial,
              std::vector<int64_t> filt, std::vector<int64_t> stride, std::vector<int64_t> pad_lo,
              std::vector<int64_t> pad_hi, std::vector<int64_t> dilation, int64_t groups,
              std::shared_ptr<Program> program) {
  auto key = operator_key(op, a, b, spatial, filt, stride, pad_lo, pad_hi, dilation, groups);
  Operators& all = operators();
  std::lock_guard<std::mutex> guard(all.lock);
  all.programs[std::move(key)] = std::move(program);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<TensorMapSpec>(m, "TensorMapSpec")
      .def(py::init([](int slot, bool im2col, int type, std::vector<cuuint64_t> dims, std::vector<cuuint64_t> strides,
                       std::vector<cuuint32_t> box, std::vector<cuuint32_t> element_strides, std::vector<int> lower,
                       std::vector<int> upper, cuuint32_t channels, cuuint32_t pixels, int swizzle) {
        TensorMapSpec s;
        s.slot = slot;
        s.im2col = im2col;
        s.type = type;
        s.dims = std::move(dims);
        s.strides = std::move(strides);
        s.box = std::move(box);
        s.element_strides = std::move(element_strides);
        s.lower = std::move(lower);
        s.upper = std::move(upper);
        s.channels = channels;
        s.pixels = pixels;
        s.swizzle = swizzle;
        return s;
      }));
  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def(py::init<std::vector<int64_t>, int, const std::string&>())
      .def("alloc", &Program::alloc)
      .def("copy", &Program::copy)
      .def("launch", &Program::launch)
      .def("run", &run_program);
  py::class_<ConvPlan, std::shared_ptr<ConvPlan>>(m, "ConvPlan")
      .def(py::init<std::shared_ptr<Program>, std::shared_ptr<Program>, std::shared_ptr<Program>, const std::string&,
                    const std::string&, int, int, py::object>());
  py::class_<BatchNormPlan, std::shared_ptr<BatchNormPlan>>(m, "BatchNormPlan")
      .def(py::init<int64_t, int64_t, bool>())
      .def("set", &BatchNormPlan::set);
  m.def("batch_norm_activation", &batch_norm_activation);
  m.def("convolution", &convolution);
  m.def("take_operators", &take_operators);
  m.def("remember", &remember);
}
