// All-or-nothing output of a set of .npy files (docs/NPY_FILES.md, "How files are read and written").
//
// Every file is first written under a temporary name in its own directory
// (".flowmoe-<pid>-<n>.tmp"); commit() then moves existing files of those names aside, renames
// the temporaries into place and removes the old files. If anything fails (a file that cannot be
// written, a name too long, a full disk, a rename) every temporary is removed and every moved
// file is put back, so the set on disk is either the complete new one or untouched; a rollback step
// that fails (e.g. the directory turned read-only) is reported in the error, never hidden. commit()
// holds an advisory lock (flock) on each output directory, so two flowmoe processes writing the same
// prefix take turns and each set lands whole; an output name that is, or becomes, a directory is
// refused and left in place. Inputs are
// read completely before an OutputSet is filled, so an output prefix equal to an input prefix
// replaces the input set atomically.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flowmoe {
namespace cli {

class OutputSet {
 public:
  OutputSet() = default;
  OutputSet(const OutputSet&) = delete;
  OutputSet& operator=(const OutputSet&) = delete;
  // Removes the temporaries of a set that was not committed.
  ~OutputSet();

  // Writes `data` (prod(shape) elements of dtype) to a temporary file for `path`. Throws
  // flowmoe::Error naming `path` when the name cannot be used or the write fails.
  void add(const std::string& path, const char* dtype, const std::vector<int64_t>& shape,
           const void* data);
  // Puts every file in place (see above), then prints one "wrote PATH DTYPE [SHAPE]" line per
  // file to stdout, in the order they were added.
  void commit();

 private:
  struct Item {
    std::string path, tmp, backup, line;
    bool installed = false, backed_up = false;
  };
  // Undoes what commit() did and drops the temporaries: "" when every step worked, else what failed.
  std::string rollback();
  std::vector<Item> items_;
  bool committed_ = false;
};

}  // namespace cli
}  // namespace flowmoe
