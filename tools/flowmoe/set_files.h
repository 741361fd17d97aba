// The file-system pieces under an output set (output_set.h): exclusive temporary files, the
// directory lock shared by writers and readers, the commit journal, the clean-up of what a killed
// flowmoe process left, and the signal handling that removes a writer's temporaries when it is
// interrupted. docs/NPY_FILES.md ("How files are read and written") describes the protocol:
//
//  - Names: every file flowmoe keeps for itself is ".flowmoe-<pid>-<16 random hex digits>.<kind>"
//    in the output's directory, kind tmp (a new file), old (an old file moved aside) or journal.
//    The random part (getrandom) makes the name unpredictable; the pid says whose it is.
//  - Temporaries are created with O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK: a symlink, hard link,
//    FIFO or anything else already at the name is never opened (another name is drawn).
//  - Writers hold an exclusive flock on the directory while they put a set in place; readers hold a
//    shared one while they read a set, so a reader sees the old set or the new one, never a mix.
//  - Before its first rename a writer writes a journal naming each file of the set, its temporary
//    and where the old file goes; it removes the journal once every new file is in place. A journal
//    of a process that no longer runs marks a set that may be mixed: readers refuse to read it, and
//    the next writer in that directory puts the old set back from it.
#pragma once

#include <signal.h>

#include <string>
#include <vector>

namespace flowmoe {
namespace cli {

// "dir/name" -> "dir" ("." when there is no directory part; "/" for "/name"), and "name".
std::string dir_of(const std::string& path);
std::string base_of(const std::string& path);
// "dir" + "/" + name (no "./" for ".").
std::string join_path(const std::string& dir, const std::string& name);

// A new, empty file ".flowmoe-<pid>-<random>.<kind>" in `dir`, created exclusively (see above) and
// open for writing. Throws flowmoe::Error (naming `for_path`) when none can be created.
struct TempFile {
  std::string path;
  int fd = -1;
};
TempFile create_temp(const std::string& dir, const char* kind, const std::string& for_path);
// A name ".flowmoe-<pid>-<random>.<kind>" in `dir`, not created (for an old file moved aside).
std::string temp_name(const std::string& dir, const char* kind);

// A flock on a directory, held for the object's lifetime: exclusive for a writer, shared for a
// reader. Waiting more than a second prints one line to stderr saying so. Where the directory
// cannot be opened or locked (no read permission, a file system without flock) it goes on without
// the lock and warns: another flowmoe process could then see or make a mixed set.
class DirLock {
 public:
  DirLock(const std::string& dir, bool exclusive);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// The journal of a commit: one entry per file of the set (base names in one directory).
struct JournalEntry {
  std::string name, tmp, backup;  // backup "" when there was no old file
};
// Writes the journal of a set into `dir`; returns its path. Throws flowmoe::Error when it cannot.
std::string write_journal(const std::string& dir, const std::vector<JournalEntry>& entries);

// Called by a writer holding the directory's exclusive lock: puts back every set that a killed
// flowmoe process was replacing (from its journal) and removes its temporaries and moved-aside
// files, printing one note per thing done to stderr, and a warning for what could not be done.
void clean_up_after_killed_writers(const std::string& dir);

// Called by a reader holding the directory's shared lock: throws flowmoe::Error, saying what to do,
// when a journal of a killed writer names one of `paths` (all in `dir`): those files may mix sets.
void refuse_torn_set(const std::string& dir, const std::vector<std::string>& paths);

// A reader's guard: the shared lock on the directory of `paths` and the torn-set check, held until
// it is destroyed. Construct it before reading the first file of a set, destroy it after the last.
class SetReadGuard {
 public:
  explicit SetReadGuard(const std::vector<std::string>& paths);

 private:
  DirLock lock_;
};

// Signals. Once install_signal_handlers() has run, SIGINT, SIGTERM, SIGHUP and SIGQUIT remove the
// registered temporaries and then end the process as the signal would have (those the caller ignores,
// e.g. SIGHUP under nohup, stay ignored); SIGXFSZ is ignored, so a write past `ulimit -f` fails
// with EFBIG and the set is rolled back like any failed write. While a SignalBlock lives those
// signals wait (the commit and its rollback run whole), and are delivered when it ends.
void install_signal_handlers();
void register_temp(const std::string& path);    // call with signals blocked
void unregister_temp(const std::string& path);  // call with signals blocked
class SignalBlock {
 public:
  SignalBlock();
  ~SignalBlock();
  SignalBlock(const SignalBlock&) = delete;
  SignalBlock& operator=(const SignalBlock&) = delete;

 private:
  sigset_t old_;  // the mask to restore
};

}  // namespace cli
}  // namespace flowmoe
