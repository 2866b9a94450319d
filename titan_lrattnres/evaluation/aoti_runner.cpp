// Run an AOTInductor package (model_aoti.pt2 of `python -m titan_lrattnres.export`) from C++,
// with no Python in the process: tokens [B, T] int64 -> logits [B, T, V] float32.
//
//   aoti_runner [--repeat N] PACKAGE B T TOKENS LOGITS [B T TOKENS LOGITS ...]
//
// TOKENS: B*T raw int64 (native byte order) token ids, row-major; LOGITS: written as B*T*V raw
// float32, row-major. Prints "B T V" per input on stdout; with --repeat N, each input runs N
// more times after the first and the median forward time is printed as "median_ms X".
// The package must be Python-free (the default export: no lrattnres:: custom-op node).
//
// Build against the libtorch of the torch wheel (docs/evaluation.md, "A Python-free loader"):
//   TORCH=$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')
//   g++ -std=c++17 -O2 -D_GLIBCXX_USE_CXX11_ABI=1 aoti_runner.cpp -o aoti_runner \
//       -I$TORCH/include -L$TORCH/lib -Wl,-rpath,$TORCH/lib -ltorch -ltorch_cpu -lc10
// (the ABI flag: python -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))').

#include <ATen/ops/from_blob.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

std::vector<int64_t> read_tokens(const std::string& path, int64_t count) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot open " + path);
  const auto bytes = static_cast<int64_t>(f.tellg());
  if (bytes != count * static_cast<int64_t>(sizeof(int64_t)))
    throw std::runtime_error(path + ": " + std::to_string(bytes) + " bytes, expected " +
                             std::to_string(count) + " int64 token ids");
  std::vector<int64_t> ids(count);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(ids.data()), bytes);
  return ids;
}

void write_floats(const std::string& path, const at::Tensor& t) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot write " + path);
  f.write(reinterpret_cast<const char*>(t.const_data_ptr<float>()),
          static_cast<std::streamsize>(t.numel() * sizeof(float)));
  if (!f) throw std::runtime_error("short write to " + path);
}

int64_t positive(const char* s, const char* what) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0' || v < 1)
    throw std::runtime_error(std::string(what) + " must be a positive integer, got " + s);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  int64_t repeat = 0;
  if (args.size() >= 2 && args[0] == "--repeat") {
    repeat = positive(args[1].c_str(), "--repeat");
    args.erase(args.begin(), args.begin() + 2);
  }
  if (args.size() < 5 || (args.size() - 1) % 4 != 0) {
    std::cerr << "usage: aoti_runner [--repeat N] PACKAGE B T TOKENS LOGITS [B T TOKENS LOGITS "
                 "...]\n";
    return 2;
  }
  try {
    torch::inductor::AOTIModelPackageLoader loader(args[0]);
    for (size_t i = 1; i < args.size(); i += 4) {
      const int64_t b = positive(args[i].c_str(), "B");
      const int64_t t = positive(args[i + 1].c_str(), "T");
      std::vector<int64_t> ids = read_tokens(args[i + 2], b * t);
      at::Tensor tokens = at::from_blob(ids.data(), {b, t}, at::kLong);
      std::vector<at::Tensor> out = loader.run({tokens});
      if (out.size() != 1) throw std::runtime_error("expected one output (the logits)");
      at::Tensor logits = out[0].to(at::kFloat).contiguous();
      if (logits.dim() != 3 || logits.size(0) != b || logits.size(1) != t)
        throw std::runtime_error("logits of unexpected shape " + std::to_string(logits.dim()) +
                                 "-d");
      write_floats(args[i + 3], logits);
      std::cout << b << " " << t << " " << logits.size(2) << std::endl;
      if (repeat > 0) {
        std::vector<double> ms;
        for (int64_t r = 0; r < repeat; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          loader.run({tokens});
          const auto t1 = std::chrono::steady_clock::now();
          ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
        std::cout << "median_ms " << ms[ms.size() / 2] << std::endl;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "aoti_runner: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
