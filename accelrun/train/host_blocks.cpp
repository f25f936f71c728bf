// accelrun's CPU allocator for training steps: large blocks kept by size, mapped once.
//
// A training step allocates the same activations, in the same sizes, every step. glibc's heap serves
// them from one arena whose frees leave holes the next step does not always fill (resident memory
// grows past what is live); mapping each block afresh leaves no holes but faults every page in again
// every step. This allocator maps a block of `min_bytes` or more once, and when the tensor is freed
// keeps the mapping on a free list keyed by its size; the next request of that size takes it back,
// pages already resident. Mapped memory stays under a mark: the most bytes live blocks held at once
// (since install; a block serving a smaller request counts whole) plus a headroom (thousandths of it).
// A request with no free block of its size (or up to 1/8 larger) takes one up to twice its size when
// mapping a new block would cross the mark; failing that, free blocks are unmapped (the longest freed
// first) until the new one fits under the mark. Smaller blocks go to
// c10's own `alloc_cpu` / `free_cpu`, as with torch's default allocator. Both report to torch's
// profiler the way the default allocator does.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kLine = 64;  // a cache line, and c10's alignment for CPU tensors

struct Counters {  // the order accelrun_blocks_stats writes them in (host_blocks.py reads this order)
  size_t live = 0, cached = 0, peak_live = 0, peak_mapped = 0;
  size_t hits = 0, misses = 0, unmapped = 0, small = 0;
  size_t requested = 0, peak_requested = 0;  // what live blocks' tensors asked for (page-rounded)
};

struct LiveBlock {
  size_t size;       // the block's usable bytes (its mapping is one page more)
  size_t requested;  // what its tensor asked for, rounded up to a page: at most `size`
};

class BlockCache final : public c10::Allocator {
 public:
  BlockCache(c10::Allocator* previous, size_t min_bytes, size_t headroom_permille)
      : previous_(previous), min_bytes_(min_bytes), headroom_permille_(headroom_permille) {}

  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (n >= min_bytes_) {
      p = take(n);
    } else {
      p = c10::alloc_cpu(n);
      small_.fetch_add(1, std::memory_order_relaxed);
    }
    c10::profiledCPUMemoryReporter().New(p, n);
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  c10::Allocator* previous() const { return previous_; }

  Counters counters() {
    std::lock_guard<std::mutex> hold(mu_);
    Counters c = counters_;
    c.small = small_.load(std::memory_order_relaxed);
    return c;
  }

  // Counts from now: the peaks restart at what is mapped now, the counts at 0 (a run's report says
  // what its own steps did, not an earlier run's in the same process).
  void restart_counters() {
    std::lock_guard<std::mutex> hold(mu_);
    Counters c;
    c.live = counters_.live;
    c.cached = counters_.cached;
    c.requested = c.peak_requested = counters_.requested;
    c.peak_live = c.live;
    c.peak_mapped = c.live + c.cached;
    counters_ = c;
    small_.store(0, std::memory_order_relaxed);
  }

  void release_cached() {  // unmaps every free block
    std::lock_guard<std::mutex> hold(mu_);
    while (!free_.empty()) unmap_oldest();
  }

  void set_active(bool active) {
    std::lock_guard<std::mutex> hold(mu_);
    active_ = active;
  }

  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

  static BlockCache* instance;

 private:
  static void release(void* p) {
    if (p == nullptr) return;
    c10::profiledCPUMemoryReporter().Delete(p);
    if (!instance->give_back(p)) c10::free_cpu(p);
  }

  // Keeps the block for the next request of its size (unmaps it once the cache is uninstalled); false
  // if the block is not one of ours.
  bool give_back(void* p) {
    std::lock_guard<std::mutex> hold(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) return false;
    size_t size = it->second.size;
    counters_.requested -= it->second.requested;
    live_.erase(it);
    counters_.live -= size;
    auto kept = free_.emplace(size, FreeBlock{p, freed_++});
    by_age_.emplace(kept->second.freed, kept);
    counters_.cached += size;
    if (!active_) unmap_oldest();  // the one just freed is the only free block then
    return true;
  }

  void* take(size_t n) {
    TORCH_CHECK_WITH(OutOfMemoryError, n <= SIZE_MAX - 2 * kPage,
                     "accelrun's CPU block cache: not enough memory: you tried to allocate ", n, " bytes");
    const size_t requested = (n + kPage - 1) / kPage * kPage;
    size_t size = requested;
    std::lock_guard<std::mutex> hold(mu_);
    void* p = nullptr;
    size_t peak = std::max(counters_.peak_live, counters_.live + size);
    size_t mark = peak + peak / 1000 * headroom_permille_;
    bool fits = counters_.live + counters_.cached + size <= mark;  // a new mapping would need no unmapping
    auto it = free_.lower_bound(size);
    // The same size or at most 1/8 larger; up to twice the size rather than unmap blocks to map a new one.
    if (it != free_.end() && (it->first <= size + size / 8 || (!fits && it->first <= 2 * size))) {
      p = it->second.p;
      size = it->first;
      by_age_.erase(it->second.freed);
      free_.erase(it);
      counters_.cached -= size;
      counters_.hits++;
    } else {
      while (!free_.empty() && counters_.live + counters_.cached + size > mark) unmap_oldest();
      p = map(size, next_offset());
      if (p == nullptr) {  // out of address space or memory: give back every free block and try once more
        while (!free_.empty()) unmap_oldest();
        p = map(size, next_offset());
      }
      TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "accelrun's CPU block cache: not enough memory: you tried to ",
                       "allocate ", n, " bytes (", counters_.live, " bytes in live blocks; mmap: ", std::strerror(errno), ")");
      counters_.misses++;
    }
    live_.emplace(p, LiveBlock{size, requested});
    counters_.live += size;
    counters_.requested += requested;
    counters_.peak_requested = std::max(counters_.peak_requested, counters_.requested);
    counters_.peak_live = std::max(counters_.peak_live, counters_.live);
    counters_.peak_mapped = std::max(counters_.peak_mapped, counters_.live + counters_.cached);
    return p;
  }

  // A block starts `offset` bytes into its mapping (one page more than `size`). Blocks that all began
  // on a page boundary made the debug Llama's step 4% slower than glibc's heap (whose blocks start
  // anywhere): a kernel reading one block and writing another at the same offset within a page has its
  // loads wait on its stores (4 KiB aliasing) and its streams compete for the same cache sets.
  static void* map(size_t size, size_t offset) {
    void* p = mmap(nullptr, size + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : static_cast<char*>(p) + offset;
  }

  size_t next_offset() { return (offsets_++ % (kPage / kLine)) * kLine; }  // mu_ held

  // The block freed longest ago goes first. With batches of changing lengths, blocks sized for the
  // length before wait beside those this step just freed and will ask for again; unmapping the
  // largest took this step's own blocks and mapped them anew each step (docs/compiler.md, 2026-12-05).
  void unmap_oldest() {  // mu_ held
    auto oldest = by_age_.begin();
    auto block = oldest->second;
    auto start = reinterpret_cast<uintptr_t>(block->second.p);
    munmap(reinterpret_cast<void*>(start - start % kPage), block->first + kPage);
    counters_.cached -= block->first;
    counters_.unmapped++;
    free_.erase(block);
    by_age_.erase(oldest);
  }

  c10::Allocator* previous_;
  size_t min_bytes_;
  size_t headroom_permille_;
  std::mutex mu_;
  std::unordered_map<void*, LiveBlock> live_;
  struct FreeBlock {
    void* p;
    uint64_t freed;  // when it was freed: a count of frees
  };
  using FreeList = std::multimap<size_t, FreeBlock>;
  FreeList free_;                                   // mapped size -> free block
  std::map<uint64_t, FreeList::iterator> by_age_;   // the same blocks, the longest freed first
  uint64_t freed_ = 0;
  Counters counters_;
  bool active_ = true;  // torch's CPU allocator now; freed blocks are kept only then
  size_t offsets_ = 0;  // blocks mapped so far: the next one's offset into its mapping
  std::atomic<size_t> small_{0};  // blocks under min_bytes handed to alloc_cpu (no lock on that path)
};

BlockCache* BlockCache::instance = nullptr;

// A fork (DataLoader workers) while another thread held the lock must not leave the child's lock held.
void before_fork() { BlockCache::instance->lock(); }
void after_fork() { BlockCache::instance->unlock(); }

}  // namespace

extern "C" {

// Makes the cache torch's CPU allocator. 1: it is; 0: another allocator with a higher priority kept its
// place. The cache lives as long as the process: tensors it handed out may outlive any uninstall.
int accelrun_blocks_install(size_t min_bytes, size_t headroom_permille) {
  if (BlockCache::instance == nullptr) {
    BlockCache::instance = new BlockCache(c10::GetCPUAllocator(), min_bytes, headroom_permille);
    pthread_atfork(before_fork, after_fork, after_fork);
  }
  c10::SetCPUAllocator(BlockCache::instance, 0);
  BlockCache::instance->set_active(true);
  BlockCache::instance->restart_counters();
  return c10::GetCPUAllocator() == BlockCache::instance ? 1 : 0;
}

// Gives torch back the allocator it had and unmaps the free blocks; blocks still live are unmapped
// when their tensors are freed.
void accelrun_blocks_uninstall() {
  if (BlockCache::instance == nullptr) return;
  if (c10::GetCPUAllocator() == BlockCache::instance) c10::SetCPUAllocator(BlockCache::instance->previous(), 0);
  BlockCache::instance->set_active(false);
  BlockCache::instance->release_cached();
}

int accelrun_blocks_installed() {
  return BlockCache::instance != nullptr && c10::GetCPUAllocator() == BlockCache::instance ? 1 : 0;
}

void accelrun_blocks_stats(size_t* out) {
  Counters c = BlockCache::instance == nullptr ? Counters{} : BlockCache::instance->counters();
  size_t values[] = {c.live,   c.cached, c.peak_live, c.peak_mapped, c.hits,
                     c.misses, c.unmapped, c.small,   c.requested,   c.peak_requested};
  std::copy(std::begin(values), std::end(values), out);
}

}  // extern "C"
