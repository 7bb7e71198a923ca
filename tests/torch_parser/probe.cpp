// Ground truth for torch's allocator-settings parser, one torch version at a time.
//
// Built against one CUDA wheel's headers and libc10/libc10_cuda (build.sh), it needs
// no GPU: torch's settings parser is plain C++. It prints torch's state once (which
// makes torch read its env variables, as at its first CUDA allocation), then answers
// lines on stdin: "set <string>" (or "setx <hex bytes>", for any character) -> "ok" or
// "err <torch's message>", "get" -> "state ...".
// TORCH_V is torch's version as major*100+minor (209 = 2.9); not "V", which 2.15's
// headers use as a template parameter name.
#include <c10/util/Exception.h>
#include <iostream>
#include <sstream>
#include <string>
#if TORCH_V >= 210
#include <c10/core/AllocatorConfig.h>
#endif
#include <c10/cuda/CUDAAllocatorConfig.h>

using namespace c10::cuda::CUDACachingAllocator;
#if TORCH_V >= 210
using AC = c10::CachingAllocator::AcceleratorAllocatorConfig;
#endif

static void dump() {
  std::ostringstream o;
#if TORCH_V >= 210
  auto ms = AC::max_split_size();
  o << "max_split_size_mb=" << (ms == SIZE_MAX ? std::string("inf") : std::to_string(ms >> 20));
  o << " max_non_split_rounding_mb=" << (AC::max_non_split_rounding_size() >> 20);
  o << " garbage_collection_threshold=" << AC::garbage_collection_threshold();
  o << " expandable_segments=" << AC::use_expandable_segments();
  o << " pinned_use_background_threads=" << AC::pinned_use_background_threads();
  o << " roundup=";
  for (size_t i = 0; i < 16; i++) o << AC::roundup_power2_divisions(size_t(1) << (20 + i)) << (i < 15 ? "," : "");
#if TORCH_V >= 211
  o << " large_segment_size_mb=" << (AC::large_segment_size() >> 20);
#endif
#if TORCH_V >= 213
  auto mr = AC::pinned_max_round_threshold(), mc = AC::pinned_max_cached_size();
  o << " pinned_max_round_threshold_mb=" << (mr == SIZE_MAX ? std::string("inf") : std::to_string(mr >> 20));
  o << " pinned_max_cached_size_mb=" << (mc == SIZE_MAX ? std::string("inf") : std::to_string(mc >> 20));
#endif
  o << " pinned_reserve_segment_size_mb=" << CUDAAllocatorConfig::pinned_reserve_segment_size_mb();
  o << " per_process_memory_fraction=" << CUDAAllocatorConfig::per_process_memory_fraction();
#else
  auto ms = CUDAAllocatorConfig::max_split_size();
  o << "max_split_size_mb=" << (ms == SIZE_MAX ? std::string("inf") : std::to_string(ms >> 20));
#if TORCH_V >= 206
  o << " max_non_split_rounding_mb=" << (CUDAAllocatorConfig::max_non_split_rounding_size() >> 20);
#endif
  o << " garbage_collection_threshold=" << CUDAAllocatorConfig::garbage_collection_threshold();
  o << " expandable_segments=" << CUDAAllocatorConfig::expandable_segments();
#if TORCH_V >= 206
  o << " pinned_use_background_threads=" << CUDAAllocatorConfig::pinned_use_background_threads();
#endif
  o << " roundup=";
  for (size_t i = 0; i < 16; i++) o << CUDAAllocatorConfig::roundup_power2_divisions(size_t(1) << (20 + i)) << (i < 15 ? "," : "");
#endif
  o << " release_lock_on_cudamalloc=" << CUDAAllocatorConfig::release_lock_on_cudamalloc();
  o << " pinned_use_cuda_host_register=" << CUDAAllocatorConfig::pinned_use_cuda_host_register();
  o << " pinned_num_register_threads=" << CUDAAllocatorConfig::pinned_num_register_threads();
#if TORCH_V >= 209
  o << " graph_capture_record_stream_reuse=" << CUDAAllocatorConfig::graph_capture_record_stream_reuse();
#endif
#if TORCH_V >= 212
  o << " pinned_free_catch_all=" << CUDAAllocatorConfig::pinned_free_catch_all();
  o << " throw_on_cudamalloc_oom=" << CUDAAllocatorConfig::throw_on_cudamalloc_oom();
#endif
  std::cout << "state " << o.str() << std::endl;
}

int main() {
  std::string line;
  // First touch: the env is read here (as torch reads it on first use).
  try {
    dump();
  } catch (const std::exception& e) {
    std::string m = e.what();
    std::cout << "envfail " << m.substr(0, m.find('\n')) << std::endl;
  }
  while (std::getline(std::cin, line)) {
    if (line == "get") { dump(); continue; }
    std::string s;
    if (line.rfind("setx ", 0) == 0) {
      for (size_t k = 5; k + 1 < line.size(); k += 2) s += char(std::stoi(line.substr(k, 2), nullptr, 16));
    } else if (line.rfind("set ", 0) == 0) {
      s = line.substr(4);
    } else {
      continue;
    }
    try {
      setAllocatorSettings(s);
      std::cout << "ok" << std::endl;
    } catch (const std::exception& e) {
      std::string m = e.what();
      std::cout << "err " << m.substr(0, m.find('\n')) << std::endl;
    }
  }
}
