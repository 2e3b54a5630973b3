// The tables file: the manifest's "tables" checked, tables.bin mapped and verified, the tensors handed to the model.
#include "tables.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/script.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iomanip>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "recship/model.h"

namespace recship::tables {
namespace {

using json = nlohmann::json;

constexpr const char* kPinnedName = "recship/tables.json";

struct DType {
  c10::ScalarType type;
  int64_t size;
};

// export/tables.py DTYPES
const std::map<std::string, DType>& dtypes() {
  static const std::map<std::string, DType> map = {
      {"uint8", {c10::kByte, 1}},    {"int8", {c10::kChar, 1}},       {"int32", {c10::kInt, 4}},
      {"int64", {c10::kLong, 8}},    {"float32", {c10::kFloat, 4}},   {"float16", {c10::kHalf, 2}},
      {"bfloat16", {c10::kBFloat16, 2}}, {"bool", {c10::kBool, 1}},
  };
  return map;
}

int threads_available() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// tables.bin mapped: released (munmap) when the last tensor made from it goes.
// One tensor's bytes of a tables file: its pages mapped (copy-on-write), or a copy on the heap where they are less
// than a page (as export/tables.py).
struct Mapping {
  char* data = nullptr;  // mapped: munmap'ed with the last tensor that views it
  size_t size = 0;
  std::vector<char> copy;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data != nullptr) munmap(data, size);
  }
};

// Tensors mapped and verified in this process, by their key (TableTensor.key() in recship/contract/tables.py): a version
// whose tables equal those of a live one takes them from its mapping once its own file has verified.
struct Live {
  std::weak_ptr<Mapping> mapping;
  char* data;
};
// Segments verified in this process, by the identity of the file that holds them (st_dev, st_ino, st_size,
// st_mtime in ns, as export/tables.py _VERIFIED): the same file is not hashed twice. Each entry: the segment's
// offset in the file, its bytes and its sha256.
using Identity = std::tuple<uint64_t, uint64_t, int64_t, int64_t>;
using Verified = std::tuple<int64_t, int64_t, std::string>;
std::mutex live_mutex;  // guards live and verified
std::map<std::string, Live> live;
std::map<Identity, std::set<Verified>> verified;

std::string key(const TableTensor& t) {
  json segments = json::array();
  for (const auto& s : t.segments) segments.push_back({s.offset, s.bytes, s.sha256});
  return json{t.dtype, t.shape, t.stride, segments}.dump();
}

// A tensor viewing `data` as t describes, keeping `mapping` alive as long as it (or a view of it) lives.
at::Tensor typed(char* data, const TableTensor& t, const std::shared_ptr<Mapping>& mapping) {
  const auto options = at::TensorOptions().dtype(dtypes().at(t.dtype).type).device(at::kCPU);
  if (span(t.shape, t.stride) == 0) return at::empty_strided(t.shape, t.stride, options);
  return at::from_blob(data, t.shape, t.stride, [mapping](void*) {}, options);
}

// One stored entry's bytes in a zip archive (the local header at `local`), or nullopt where it does not fit.
std::optional<std::string> stored_entry(const std::string& a, uint64_t local, uint64_t size) {
  auto u16 = [&a](uint64_t at) { return static_cast<uint32_t>(static_cast<unsigned char>(a[at])) | static_cast<uint32_t>(static_cast<unsigned char>(a[at + 1])) << 8; };
  auto u32 = [&a, &u16](uint64_t at) { return u16(at) | u16(at + 2) << 16; };
  if (local > a.size() || a.size() - local < 30 || u32(local) != 0x04034b50) return std::nullopt;
  const uint64_t start = local + 30 + u16(local + 26) + u16(local + 28);
  if (start > a.size() || a.size() - start < size) return std::nullopt;
  return a.substr(start, size);
}

}  // namespace

// Elements a tensor of shape and stride reaches (0 if empty), saturating far above any file size.
unsigned __int128 span(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride) {
  for (int64_t n : shape)
    if (n == 0) return 0;
  const unsigned __int128 cap = static_cast<unsigned __int128>(1) << 100;
  unsigned __int128 total = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    unsigned __int128 term = static_cast<unsigned __int128>(shape[i] - 1) * static_cast<unsigned __int128>(stride[i]);
    total = std::min(cap, total + std::min(cap, term));
  }
  return total;
}

// A digest's bytes as lower-case hex.
static std::string hex_of(const unsigned char* digest, unsigned int len) {
  static const char* hex = "0123456789abcdef";
  std::string out(2 * len, '0');
  for (unsigned int i = 0; i < len; ++i) {
    out[2 * i] = hex[digest[i] >> 4];
    out[2 * i + 1] = hex[digest[i] & 15];
  }
  return out;
}

std::string sha256_hex(const void* data, size_t n) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(data, n, digest, &len, EVP_sha256(), nullptr) != 1) throw Error("sha256 failed");
  return hex_of(digest, len);
}

int open_file(const std::string& path, struct stat* st) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  if (fstat(fd, st) != 0 || S_ISDIR(st->st_mode)) {
    const int error = S_ISDIR(st->st_mode) ? EISDIR : errno;
    close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

bool read_chunks(const std::string& path, size_t chunk, struct stat* st, const std::function<void(const char*, size_t)>& use) {
  const int fd = open_file(path, st);
  if (fd < 0) return false;
  std::vector<char> buffer(chunk);
  for (;;) {
    const ssize_t n = read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      close(fd);
      errno = error;
      return false;
    }
    if (n == 0) break;
    use(buffer.data(), static_cast<size_t>(n));
  }
  close(fd);
  return true;
}

std::optional<std::string> sha256_file(const std::string& path) {
  struct stat st {};
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) throw Error("sha256 failed");
  if (!read_chunks(path, 1 << 20, &st, [&ctx](const char* data, size_t n) { EVP_DigestUpdate(ctx.get(), data, n); }))
    return std::nullopt;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(ctx.get(), digest, &len) != 1) throw Error("sha256 failed");
  return hex_of(digest, len);
}


json Spec::to_json() const {
  json tensors_json = json::array();
  for (const auto& t : tensors) {
    json segments = json::array();
    for (const auto& s : t.segments) {
      json seg = {{"name", s.name}, {"offset", s.offset}, {"bytes", s.bytes}, {"sha256", s.sha256}};
      if (s.rows) seg["rows"] = *s.rows;
      segments.push_back(std::move(seg));
    }
    tensors_json.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"stride", t.stride},
                            {"offset", t.offset}, {"bytes", t.bytes},
                            {"torchscript", t.torchscript ? json(*t.torchscript) : json(nullptr)},
                            {"aoti", t.aoti ? json(*t.aoti) : json(nullptr)}, {"segments", std::move(segments)}});
  }
  return {{"file", file}, {"bytes", bytes}, {"tensors", std::move(tensors_json)}};
}

int64_t dtype_size(const std::string& dtype) { return dtypes().at(dtype).size; }

Spec parse_spec(const json& spec) {
  Spec out{spec["file"].get<std::string>(), spec["bytes"].get<int64_t>(), {}};
  for (const auto& t : spec["tensors"]) {
    TableTensor entry{t["name"].get<std::string>(), t["dtype"].get<std::string>(), t["shape"].get<std::vector<int64_t>>(),
                      t["stride"].get<std::vector<int64_t>>(), t["offset"].get<int64_t>(), t["bytes"].get<int64_t>(), {},
                      std::nullopt, std::nullopt};
    if (!t["torchscript"].is_null()) entry.torchscript = t["torchscript"].get<std::string>();
    if (!t["aoti"].is_null()) entry.aoti = t["aoti"].get<std::string>();
    for (const auto& s : t["segments"]) {
      Segment segment{s["name"].get<std::string>(), s["offset"].get<int64_t>(), s["bytes"].get<int64_t>(), s["sha256"].get<std::string>(),
                      std::nullopt};
      if (s.contains("rows") && !s["rows"].is_null()) segment.rows = s["rows"].get<int64_t>();
      entry.segments.push_back(std::move(segment));
    }
    out.tensors.push_back(std::move(entry));
  }
  return out;
}

std::pair<std::string, std::optional<int64_t>> split_shard(const std::string& name) {
  const size_t at = name.rfind('@');
  if (at == std::string::npos || at + 1 == name.size() || name.size() - at - 1 > 18 ||
      name.find_first_not_of("0123456789", at + 1) != std::string::npos)
    return {name, std::nullopt};
  return {name.substr(0, at), std::stoll(name.substr(at + 1))};
}

std::pair<std::string, std::string> split_table_name(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return {"", name};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

std::map<std::string, at::Tensor> map_tables(const std::string& dir, const Spec& spec) {
  const std::string file = dir + "/" + spec.file;
  const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    const int error = fd < 0 ? errno : S_ISDIR(st.st_mode) ? EISDIR : errno;
    if (fd >= 0) close(fd);
    throw ArtifactError(dir + ": " + spec.file + " cannot be read (" + std::strerror(error) + "): the artifact is incomplete");
  }
  const int64_t size = st.st_size;
  if (size != spec.bytes) {
    close(fd);
    std::string short_of;  // the first table the file is too short for
    for (const auto& t : spec.tensors) {
      for (const auto& s : t.segments)
        if (t.offset + s.offset + s.bytes > size) {
          short_of = "table " + py_repr(s.name) + " of " + t.name + " needs bytes up to " + std::to_string(t.offset + s.offset + s.bytes);
          break;
        }
      if (!short_of.empty()) break;
    }
    throw ArtifactError(file + ": " + std::to_string(size) + " bytes, the manifest says " + std::to_string(spec.bytes) +
                        (short_of.empty() ? "" : " (truncated: " + short_of + ")") + "; re-copy or re-export the artifact");
  }

  // each tensor's pages mapped on their own, copy-on-write (as export/tables.py): the pages are the page cache's, shared
  // by every process mapping the file, until someone writes to one (nobody does: the model reads its tables); a tensor
  // another version shares (below) keeps only its own pages mapped, not this file's other tables; small ones (a TBE's
  // offsets, equal in every retrain) are copies
  std::map<std::string, std::shared_ptr<Mapping>> mappings;
  std::map<std::string, char*> starts;
  const int64_t page = sysconf(_SC_PAGESIZE);
  for (const auto& t : spec.tensors) {
    auto mapping = std::make_shared<Mapping>();
    starts[t.name] = nullptr;
    if (t.bytes > 0 && t.bytes < page) {  // a copy: a mapping would hold a page (and the file's blocks, once deleted)
      mapping->copy.resize(static_cast<size_t>(t.bytes));
      if (pread(fd, mapping->copy.data(), mapping->copy.size(), static_cast<off_t>(t.offset)) != t.bytes) {
        const int error = errno;
        close(fd);
        throw ArtifactError(file + " cannot be read (" + std::strerror(error) + ")");
      }
      starts[t.name] = mapping->copy.data();
    } else if (t.bytes > 0) {
      const int64_t begin = t.offset - t.offset % page;
      const size_t length = static_cast<size_t>(t.offset + t.bytes - begin);
      void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, static_cast<off_t>(begin));
      if (data == MAP_FAILED) {
        const int error = errno;
        close(fd);
        throw ArtifactError(file + " cannot be mapped (" + std::strerror(error) + ")");
      }
      mapping->data = static_cast<char*>(data);
      mapping->size = length;
      starts[t.name] = mapping->data + (t.offset - begin);
    }
    mappings[t.name] = mapping;
  }
  close(fd);  // the mappings stay valid without it

  // every segment this file holds is verified, but for those this process already verified in the very same
  // file (same device, inode, size and mtime: a version loaded again, a tables.bin hard-linked into the next)
  const Identity identity{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), size,
                          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
  std::set<Verified> done;
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    auto it = verified.find(identity);
    if (it != verified.end()) done = it->second;
  }
  struct Job {
    const TableTensor* tensor;
    const Segment* segment;
    std::string problem;
  };
  std::vector<Job> jobs;
  for (const auto& t : spec.tensors)
    for (const auto& s : t.segments)
      if (!done.count(Verified{t.offset + s.offset, s.bytes, s.sha256})) jobs.push_back({&t, &s, ""});
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < jobs.size(); i = next++) {
      const TableTensor& t = *jobs[i].tensor;
      const Segment& s = *jobs[i].segment;
      const std::string digest = sha256_hex(starts.at(t.name) + s.offset, static_cast<size_t>(s.bytes));
      if (digest != s.sha256)
        jobs[i].problem = file + ": " + (s.rows ? "table " : "constant ") + py_repr(s.name) + " (bytes " +
                          std::to_string(t.offset + s.offset) + ".." + std::to_string(t.offset + s.offset + s.bytes) + " of " +
                          t.name + ") has sha256 " + digest + ", the manifest says " + s.sha256 +
                          ": the file is corrupt or from another artifact";
    }
  };
  const size_t threads = std::min<size_t>(static_cast<size_t>(threads_available()), jobs.size());
  std::vector<std::thread> pool;
  for (size_t i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  std::string first;
  size_t problems = 0;
  for (const auto& job : jobs)
    if (!job.problem.empty() && problems++ == 0) first = job.problem;
  if (problems > 0)
    throw ArtifactError(first + (problems > 1 ? " (and " + std::to_string(problems - 1) + " more)" : ""));

  // only now that this file verified: a tensor equal to one a live version uses (same layout and checksums) is
  // taken from that version's mapping, so the two share their pages; each of this file's mappings goes (munmap) with
  // the last tensor made from it, at once where none is
  std::map<std::string, at::Tensor> out;
  std::lock_guard<std::mutex> lock(live_mutex);
  auto& mine = verified[identity];
  for (const auto& job : jobs) mine.insert(Verified{job.tensor->offset + job.segment->offset, job.segment->bytes, job.segment->sha256});
  for (const auto& t : spec.tensors) {
    const std::string k = key(t);
    auto it = live.find(k);
    std::shared_ptr<Mapping> shared = it == live.end() ? nullptr : it->second.mapping.lock();
    if (shared) {
      out[t.name] = typed(it->second.data, t, shared);
      continue;
    }
    char* data = starts.at(t.name);
    out[t.name] = typed(data, t, mappings.at(t.name));
    if (span(t.shape, t.stride) > 0) live[k] = {mappings.at(t.name), data};
  }
  for (auto it = live.begin(); it != live.end();) it = it->second.mapping.expired() ? live.erase(it) : std::next(it);
  return out;
}

void check_pinned(const std::optional<std::string>& pinned, const Spec& spec, const std::string& file) {
  if (!pinned || pinned->find_first_not_of(" \t\r\n\f\v") == std::string::npos)
    throw ArtifactError(file + " does not say which tables it was exported with (" + kPinnedName + " is missing)");
  json copy;
  try {
    copy = json::parse(*pinned);
  } catch (const json::exception&) {
    throw ArtifactError(file + ": its " + kPinnedName + " is not valid JSON");
  }
  if (copy != spec.to_json())
    throw ArtifactError(file + " was exported with other tables than manifest.json describes: "
                        "the manifest or tables.bin belongs to another artifact");
}

std::optional<std::string> zip_entry(const std::string& a, const std::string& suffix) {
  auto u16 = [&a](uint64_t at) -> uint64_t { return static_cast<unsigned char>(a[at]) | static_cast<uint64_t>(static_cast<unsigned char>(a[at + 1])) << 8; };
  auto u32 = [&u16](uint64_t at) -> uint64_t { return u16(at) | u16(at + 2) << 16; };
  auto u64 = [&u32](uint64_t at) -> uint64_t { return u32(at) | u32(at + 4) << 32; };
  // the end of central directory record: the last one, within its 22 bytes plus a comment of up to 64 KiB
  if (a.size() < 22) return std::nullopt;
  uint64_t eocd = a.size() - 22;
  const uint64_t lowest = a.size() > 22 + 65535 ? a.size() - 22 - 65535 : 0;
  while (u32(eocd) != 0x06054b50) {
    if (eocd == lowest) return std::nullopt;
    --eocd;
  }
  uint64_t entries = u16(eocd + 10), cd = u32(eocd + 16);
  if ((entries == 0xffff || cd == 0xffffffff) && eocd >= 20 && u32(eocd - 20) == 0x07064b50) {  // zip64
    const uint64_t record = u64(eocd - 20 + 8);
    if (record > a.size() || a.size() - record < 56 || u32(record) != 0x06064b50) return std::nullopt;
    entries = u64(record + 32);
    cd = u64(record + 48);
  }
  uint64_t at = cd;
  for (uint64_t i = 0; i < entries; ++i) {
    if (at > a.size() || a.size() - at < 46 || u32(at) != 0x02014b50) return std::nullopt;
    const uint64_t method = u16(at + 10), name_len = u16(at + 28), extra_len = u16(at + 30), comment_len = u16(at + 32);
    uint64_t csize = u32(at + 20), usize = u32(at + 24), local = u32(at + 42);
    if (a.size() - at - 46 < name_len + extra_len + comment_len) return std::nullopt;
    const std::string name = a.substr(at + 46, name_len);
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      // the zip64 extra field holds, in this order, the sizes and offset whose 32-bit fields are all ones
      for (uint64_t x = at + 46 + name_len; x + 4 <= at + 46 + name_len + extra_len;) {
        const uint64_t id = u16(x), len = u16(x + 2);
        uint64_t f = x + 4;
        if (id == 1) {
          if (usize == 0xffffffff && f + 8 <= x + 4 + len) usize = u64(f), f += 8;
          if (csize == 0xffffffff && f + 8 <= x + 4 + len) csize = u64(f), f += 8;
          if (local == 0xffffffff && f + 8 <= x + 4 + len) local = u64(f), f += 8;
        }
        x += 4 + len;
      }
      if (method != 0 || csize != usize) return std::nullopt;  // stored entries only (zipfile's default)
      return stored_entry(a, local, usize);
    }
    at += 46 + name_len + extra_len + comment_len;
  }
  return std::nullopt;
}

void attach_torchscript(torch::jit::Module& module, const Spec& spec, const std::map<std::string, at::Tensor>& tensors,
                        const std::string& where) {
  for (const auto& t : spec.tensors) {
    if (!t.torchscript) continue;
    const std::string& path = *t.torchscript;
    std::vector<std::string> parts;
    for (size_t start = 0;;) {
      const size_t dot = path.find('.', start);
      parts.push_back(path.substr(start, dot - start));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    torch::jit::Module owner = module;  // a handle: setattr on it changes the loaded module
    bool found = true;
    for (size_t i = 0; found && i + 1 < parts.size(); ++i) {
      found = owner.hasattr(parts[i]) && owner.attr(parts[i]).isObject();
      if (found) owner = torch::jit::Module(owner.attr(parts[i]).toObject());
    }
    if (!found || !owner.hasattr(parts.back()))
      throw ArtifactError(where + ": model.pt has no buffer " + path + " for " + t.name);
    const c10::IValue placeholder = owner.attr(parts.back());
    if (!placeholder.isTensor() || placeholder.toTensor().numel() != 0 ||
        placeholder.toTensor().scalar_type() != dtypes().at(t.dtype).type)
      throw ArtifactError(where + ": model.pt's " + path + " is not an empty " + t.dtype + " placeholder");
    const at::Tensor& value = tensors.at(t.name);
    const c10::Device device = placeholder.toTensor().device();
    try {
      owner.setattr(parts.back(), device.is_cpu() ? value : value.to(device));
    } catch (const c10::Error& e) {
      throw ArtifactError(where + ": model.pt's " + path + " cannot take " + t.name + ": " + e.what_without_backtrace());
    }
  }
}

std::unordered_map<std::string, at::Tensor> aoti_constants(const Spec& spec, const std::map<std::string, at::Tensor>& tensors) {
  std::unordered_map<std::string, at::Tensor> out;
  for (const auto& t : spec.tensors) {
    if (!t.aoti) continue;
    const at::Tensor& value = tensors.at(t.name);
    // an alias that owns nothing: torch 2.13's AOTI runtime keeps a reference to each user-managed constant it is
    // given and never drops it, which would keep the mapping (and its pages) for the life of the process
    out[*t.aoti] = value.numel() == 0 ? value : at::from_blob(value.data_ptr(), value.sizes(), value.strides(), value.options());
  }
  return out;
}

}  // namespace recship::tables

namespace recship {

std::string py_repr(const std::string& text, size_t limit) {
  size_t chars = 0, cut = text.size();
  for (size_t i = 0; i < text.size(); ++i)
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80 && chars++ == limit) cut = i;
  const std::string head = text.substr(0, cut);
  const char quote = head.find('\'') != std::string::npos && head.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : head) {
    if (c == '\\' || c == static_cast<unsigned char>(quote)) out += '\\', out += static_cast<char>(c);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  out += quote;
  return cut == text.size() ? out : out + "... (" + std::to_string(chars) + " characters)";
}

}  // namespace recship
