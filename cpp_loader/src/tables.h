// The tables file of a "recship.artifact/2" artifact (recship/contract/tables.py, export/tables.py): each table's rows once in tables.bin,
// page-aligned, described by the manifest's "tables"; mapped copy-on-write at load, each segment's sha256
// verified in parallel, then handed to model.pt (its empty placeholder buffers) or model.pt2 (its constants).
// Internal to the loader: messages are export/tables.py's, word for word, where the tests compare them.
#pragma once

#include <ATen/Tensor.h>

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "recship/model.h"

namespace torch::jit {
struct Module;
}

namespace recship::tables {

// Bytes [offset, offset + bytes) of one tensor (offset relative to the tensor): one table's rows (rows set) or a
// whole dense constant (rows unset).
struct Segment {
  std::string name;
  int64_t offset = 0;
  int64_t bytes = 0;
  std::string sha256;
  std::optional<int64_t> rows;
};

// One tensor of the file: dtype [shape] with stride at byte offset; torchscript: the model.pt buffer it fills
// (a dotted path), aoti: the model.pt2 constant it is (its fqn).
struct TableTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;
  int64_t offset = 0;
  int64_t bytes = 0;
  std::vector<Segment> segments;
  std::optional<std::string> torchscript;
  std::optional<std::string> aoti;
};

struct Spec {
  std::string file;
  int64_t bytes = 0;
  std::vector<TableTensor> tensors;

  // TablesSpec.to_dict(): what model.pt / model.pt2 carry as recship/tables.json (compared as parsed JSON).
  nlohmann::json to_json() const;
};

// The manifest's "tables", typed: of a manifest check_manifest accepted (manifest.schema.json's fields, rules.py's
// tables-layout).
Spec parse_spec(const nlohmann::json& tables);

// Elements a tensor of shape and stride reaches (0 if empty), saturating far above any file size.
unsigned __int128 span(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride);

// Bytes per element of a dtype the manifest's tables may name (manifest.schema.json lists them; recship/contract/tables.py
// DTYPE_SIZES says the same).
int64_t dtype_size(const std::string& dtype);

// (table, block index) of a TBE table's name "<table>@<index>" (recship/contract/tables.py split_shard); no index for a
// whole table.
std::pair<std::string, std::optional<int64_t>> split_shard(const std::string& name);

// (module path, table) of a feature's table "<module path>.<table>" (recship/contract/tables.py split_table_name).
std::pair<std::string, std::string> split_table_name(const std::string& name);

// name -> tensor of every tensor of dir/tables.bin, mapped (MAP_PRIVATE: copy-on-write, never on the heap), every
// segment's sha256 verified on several threads, unless this process already verified the same file (same device,
// inode, size and mtime). Once the file verified, a tensor whose layout and checksums equal one a live version
// uses is taken from that version's mapping (the two share their pages), and this file's mapping is dropped where
// no tensor of it is used. ArtifactError names the table of the first problem with export/tables.py map_tables'
// message.
std::map<std::string, at::Tensor> map_tables(const std::string& dir, const Spec& spec);

// The copy of the tables spec a model file carries must equal the manifest's (check_pinned); file names the model file.
void check_pinned(const std::optional<std::string>& pinned, const Spec& spec, const std::string& file);

// The first stored (uncompressed) entry of the zip archive `archive` whose name ends with `suffix`, or nullopt
// (no such entry, a compressed one, or not a zip archive).
std::optional<std::string> zip_entry(const std::string& archive, const std::string& suffix);

// Fills model.pt's empty placeholder buffers with the mapped tensors (attach_torchscript); where: the artifact folder.
void attach_torchscript(torch::jit::Module& module, const Spec& spec, const std::map<std::string, at::Tensor>& tensors,
                        const std::string& where);

// fqn -> tensor of every constant model.pt2 takes from the tables file, as aliases that do not own their memory
// (AOTI keeps a reference to each user-managed constant for good): the caller keeps `tensors` alive while the model is.
std::unordered_map<std::string, at::Tensor> aoti_constants(const Spec& spec, const std::map<std::string, at::Tensor>& tensors);

// Lowercase hex sha256 of n bytes (OpenSSL EVP).
std::string sha256_hex(const void* data, size_t n);

// Lowercase hex sha256 of the file at path, read as a stream; nullopt (errno set) if it cannot be opened or read.
std::optional<std::string> sha256_file(const std::string& path);

// A regular file opened read-only (its stat in *st), or -1 with errno set (a folder: EISDIR).
int open_file(const std::string& path, struct stat* st);

// Reads the regular file at path (its stat in *st) `chunk` bytes at a time, each chunk given to `use`; false with
// errno set if it cannot be opened or read.
bool read_chunks(const std::string& path, size_t chunk, struct stat* st, const std::function<void(const char*, size_t)>& use);

using recship::py_repr;  // (recship/model.h)

}  // namespace recship::tables
