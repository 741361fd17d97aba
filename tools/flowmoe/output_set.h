// All-or-nothing output of a set of .npy files (docs/NPY_FILES.md, "How files are read and written").
//
// add() writes every file under an exclusively created temporary name in its own directory
// (".flowmoe-<pid>-<random>.tmp", set_files.h); commit() then takes the directory's exclusive lock,
// writes a journal of the set, moves existing files of those names aside, renames the temporaries
// into place, removes the journal (the set is now whole) and then the old files. If anything fails
// (a file that cannot be written, a name too long, a full disk, `ulimit -f`, a rename) every
// temporary is removed and every moved file is put back, so the set on disk is either the complete
// new one or untouched; a rollback step that fails (e.g. the directory turned read-only) is reported
// in the error, never hidden, and its journal kept. SIGINT, SIGTERM, SIGHUP and SIGQUIT wait while
// the renames run and, at any other time, remove the temporaries before the process ends; after a
// SIGKILL the journal lets readers refuse the set and the next writer put the old one back. Readers
// take the directory's shared lock (SetReadGuard), so they see the old set or the new one. Two
// writers of one prefix take turns; an output name that is, or becomes, a directory is refused and
// left in place. Inputs are read completely before an OutputSet is filled, so an output prefix
// equal to an input prefix replaces the input set atomically. Every file of one set must be in one
// directory.
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
  std::string dir_;      // the directory of every file of the set
  std::string journal_;  // the commit's journal while it is on disk
  // Undoes what commit() did and drops the temporaries: "" when every step worked, else what failed.
  std::string rollback();
  std::vector<Item> items_;
  bool committed_ = false;
};

}  // namespace cli
}  // namespace flowmoe
