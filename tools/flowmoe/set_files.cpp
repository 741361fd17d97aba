// The file-system pieces under an output set (see set_files.h for the protocol).
#include "set_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>

#include "flowmoe/error.h"

namespace flowmoe {
namespace cli {

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}
std::string base_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}
std::string join_path(const std::string& dir, const std::string& name) {
  if (dir == ".") return name;
  return (dir == "/" ? "" : dir) + "/" + name;
}

namespace {

constexpr char kPrefix[] = ".flowmoe-";
constexpr size_t kPrefixLen = sizeof(kPrefix) - 1;
constexpr char kJournalHead[] = "flowmoe output-set journal 1\n";
constexpr char kJournalTail[] = "\nend\n";

// 16 hex digits from the kernel's random source (getrandom, else /dev/urandom). Should both fail,
// the clock and a counter stand in: the name is then guessable, but O_EXCL | O_NOFOLLOW still
// keeps whatever is planted at it from being opened.
std::string random_hex() {
  unsigned char b[8];
  ssize_t got = getrandom(b, sizeof b, 0);
  if (got != static_cast<ssize_t>(sizeof b)) {
    got = -1;
    const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      got = ::read(fd, b, sizeof b);
      ::close(fd);
    }
  }
  if (got != static_cast<ssize_t>(sizeof b)) {
    static unsigned long counter = 0;
    timespec ts{};
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long v = static_cast<unsigned long long>(ts.tv_nsec) ^ (static_cast<unsigned long long>(ts.tv_sec) << 20) ^
                           (++counter * 0x9E3779B97F4A7C15ull);
    std::memcpy(b, &v, sizeof b);
  }
  static const char hex[] = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s += hex[c >> 4];
    s += hex[c & 15];
  }
  return s;
}

mode_t type_no_follow(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 ? (st.st_mode & S_IFMT) : 0;
}

// A name of flowmoe's own: ".flowmoe-<pid>-<anything>.<kind>", kind tmp, old or journal. Returns
// false for anything else (the user's files are never touched).
bool parse_own_name(const std::string& name, long* pid, std::string* kind) {
  if (name.compare(0, kPrefixLen, kPrefix) != 0) return false;
  size_t i = kPrefixLen;
  long p = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && p < 100000000) p = p * 10 + (name[i++] - '0');
  if (i == kPrefixLen || i >= name.size() || name[i] != '-' || p <= 0) return false;
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || dot <= i) return false;
  *kind = name.substr(dot + 1);
  *pid = p;
  return *kind == "tmp" || *kind == "old" || *kind == "journal";
}

// Whether a process of that pid runs (EPERM: it runs, as another user). Our own pid counts as running.
bool process_runs(long pid) {
  if (pid == static_cast<long>(getpid())) return true;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// Reads a journal: false when it is not a complete one (a writer killed while writing it had not
// renamed anything yet).
bool read_journal(const std::string& path, std::vector<JournalEntry>* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  std::string text;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size < (1 << 20)) {
    text.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t r = ::read(fd, &text[got], text.size() - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    text.resize(got);
  }
  ::close(fd);
  const size_t head = sizeof(kJournalHead) - 1, tail = sizeof(kJournalTail) - 1;
  if (text.size() < head + tail || text.compare(0, head, kJournalHead) != 0 ||
      text.compare(text.size() - tail, tail, kJournalTail) != 0)
    return false;
  std::vector<std::string> fields;
  size_t at = head;
  const size_t end = text.size() - tail;
  while (at < end) {
    const size_t nul = text.find('\0', at);
    if (nul == std::string::npos || nul >= end) return false;
    fields.push_back(text.substr(at, nul - at));
    at = nul + 1;
  }
  if (fields.size() % 3 != 0) return false;
  out->clear();
  for (size_t i = 0; i < fields.size(); i += 3) out->push_back({fields[i], fields[i + 1], fields[i + 2]});
  return true;
}

// flowmoe's own files in `dir`: {name, pid, kind}.
struct OwnFile {
  std::string name;
  long pid;
  std::string kind;
};
std::vector<OwnFile> own_files(const std::string& dir) {
  std::vector<OwnFile> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = readdir(d)) {
    OwnFile f{e->d_name, 0, ""};
    if (parse_own_name(f.name, &f.pid, &f.kind)) out.push_back(f);
  }
  closedir(d);
  return out;
}

// Puts back the set a killed writer was replacing (its journal `entries`); "" when every step
// worked, else what failed. Each file is in one of three states: not yet touched (the temporary and
// the old file at its name), moved aside (the old file at its backup name) or replaced (the new file
// at its name, no temporary).
std::string undo_journal(const std::string& dir, const std::vector<JournalEntry>& entries) {
  std::string failed;
  for (auto e = entries.rbegin(); e != entries.rend(); ++e) {
    const std::string path = join_path(dir, e->name), tmp = join_path(dir, e->tmp);
    const bool tmp_there = type_no_follow(tmp) != 0;
    if (!e->backup.empty() && type_no_follow(join_path(dir, e->backup)) != 0) {
      if (std::rename(join_path(dir, e->backup).c_str(), path.c_str()) != 0)
        failed += " could not move " + e->backup + " back to " + e->name + " (" + std::strerror(errno) + ");";
    } else if (e->backup.empty() && !tmp_there && type_no_follow(path) == S_IFREG) {
      if (::unlink(path.c_str()) != 0)  // a new file where there was none
        failed += " could not remove the new " + e->name + " (" + std::strerror(errno) + ");";
    }
    if (tmp_there && ::unlink(tmp.c_str()) != 0)
      failed += " could not remove " + e->tmp + " (" + std::strerror(errno) + ");";
  }
  return failed;
}

// ---- signals --------------------------------------------------------------------------------

constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
constexpr int kMaxTemps = 32;
constexpr size_t kMaxPath = 4096;
char g_temps[kMaxTemps][kMaxPath];          // the registered temporaries (written with signals blocked)
volatile sig_atomic_t g_used[kMaxTemps];    // 1 where g_temps[i] holds one

extern "C" void on_signal(int sig) {
  // Only async-signal-safe calls: unlink, sigaction, raise. The signal is blocked while this runs,
  // so raise() leaves it pending and it ends the process (SIG_DFL) when the handler returns.
  for (int i = 0; i < kMaxTemps; ++i)
    if (g_used[i]) ::unlink(g_temps[i]);
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);
}

sigset_t handled_set() {
  sigset_t s;
  sigemptyset(&s);
  for (int sig : kHandled) sigaddset(&s, sig);
  return s;
}

}  // namespace

std::string temp_name(const std::string& dir, const char* kind) {
  return join_path(dir, std::string(kPrefix) + std::to_string(static_cast<long>(getpid())) + "-" + random_hex() +
                            "." + kind);
}

TempFile create_temp(const std::string& dir, const char* kind, const std::string& for_path) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    TempFile t;
    t.path = temp_name(dir, kind);
    // O_EXCL: never an existing file, symlink (not followed: O_NOFOLLOW), hard link or FIFO;
    // O_NONBLOCK: no open can wait on anything.
    t.fd = ::open(t.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0666);
    if (t.fd >= 0) return t;
    if (errno != EEXIST) break;
  }
  FLOWMOE_CHECK(false, for_path << ": cannot create a temporary file in '" << dir << "' (" << std::strerror(errno)
                                << "); nothing of the output set was written");
  return {};
}

DirLock::DirLock(const std::string& dir, bool exclusive) {
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int err = fd_ < 0 ? errno : 0;
  const int op = exclusive ? LOCK_EX : LOCK_SH;
  if (fd_ >= 0 && flock(fd_, op | LOCK_NB) != 0) {
    err = errno;
    // Another flowmoe process holds it: poll for a second, then say so and wait.
    for (int i = 0; i < 50 && err == EWOULDBLOCK; ++i) {
      const timespec tick{0, 20 * 1000 * 1000};
      nanosleep(&tick, nullptr);
      err = flock(fd_, op | LOCK_NB) == 0 ? 0 : errno;
    }
    if (err == EWOULDBLOCK) {
      std::cerr << "flowmoe: waiting for another flowmoe process " << (exclusive ? "reading or writing" : "writing")
                << " files in '" << dir << "' (it holds the directory's lock)...\n";
      while ((err = flock(fd_, op) == 0 ? 0 : errno) == EINTR) {
      }
    }
    if (err != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  if (fd_ < 0)
    std::cerr << "flowmoe: warning: '" << dir << "': the directory cannot be locked (" << std::strerror(err)
              << "); a flowmoe process writing there at the same time could "
              << (exclusive ? "mix its files with this set" : "be seen half-way") << "\n";
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // (releases the lock)
}

std::string write_journal(const std::string& dir, const std::vector<JournalEntry>& entries) {
  std::string text = kJournalHead;
  for (const JournalEntry& e : entries) {
    for (const std::string* s : {&e.name, &e.tmp, &e.backup}) {
      text += *s;
      text += '\0';
    }
  }
  text += kJournalTail;
  const TempFile j = create_temp(dir, "journal", join_path(dir, entries.empty() ? "" : entries[0].name));
  size_t done = 0;
  int err = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(j.fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      err = w < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(w);
  }
  if (::close(j.fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    ::unlink(j.path.c_str());
    FLOWMOE_CHECK(false, "cannot write the commit record " << j.path << " (" << std::strerror(err) << ")");
  }
  return j.path;
}

void clean_up_after_killed_writers(const std::string& dir) {
  const std::vector<OwnFile> files = own_files(dir);
  // First the journals: they need the moved-aside files that the second pass would remove.
  for (const OwnFile& f : files) {
    if (f.kind != "journal" || process_runs(f.pid)) continue;
    const std::string path = join_path(dir, f.name);
    std::vector<JournalEntry> entries;
    std::string failed;
    if (read_journal(path, &entries)) {  // (an incomplete journal: nothing had been renamed)
      failed = undo_journal(dir, entries);
      if (failed.empty()) {
        std::string names;
        for (const JournalEntry& e : entries) names += " " + e.name;
        std::cerr << "flowmoe: note: '" << dir << "': put back the files that flowmoe process " << f.pid
                  << " was replacing when it was killed:" << names << "\n";
      }
    }
    if (failed.empty() && ::unlink(path.c_str()) != 0) failed = std::string(" ") + std::strerror(errno);
    if (!failed.empty())
      std::cerr << "flowmoe: warning: '" << dir << "': could not put back the set that flowmoe process " << f.pid
                << " was replacing when it was killed (its record " << f.name << " is kept):" << failed << "\n";
  }
  std::string removed;
  int n = 0;
  for (const OwnFile& f : files) {
    if (f.kind == "journal" || process_runs(f.pid)) continue;
    const std::string path = join_path(dir, f.name);
    const mode_t t = type_no_follow(path);
    if (t == 0 || t == S_IFDIR) continue;  // gone (undone above), or not ours to remove
    if (::unlink(path.c_str()) == 0) {
      removed += " " + f.name;
      ++n;
    } else {
      std::cerr << "flowmoe: warning: '" << dir << "': could not remove " << f.name << ", left by a killed flowmoe "
                << "process (" << std::strerror(errno) << ")\n";
    }
  }
  if (n > 0)
    std::cerr << "flowmoe: note: '" << dir << "': removed " << n << " file(s) left by killed flowmoe process(es):"
              << removed << "\n";
}

void refuse_torn_set(const std::string& dir, const std::vector<std::string>& paths) {
  for (const OwnFile& f : own_files(dir)) {
    if (f.kind != "journal") continue;
    std::vector<JournalEntry> entries;
    if (!read_journal(join_path(dir, f.name), &entries)) continue;
    for (const JournalEntry& e : entries)
      for (const std::string& p : paths)
        FLOWMOE_CHECK(base_of(p) != e.name,
                      p << ": flowmoe process " << f.pid << " was stopped while replacing this set, so its files may "
                        << "mix the old set and the new one (its record is " << join_path(dir, f.name)
                        << "); nothing was read. The next flowmoe command that writes into '" << dir
                        << "' puts the old set back: run the interrupted command again");
  }
}

SetReadGuard::SetReadGuard(const std::vector<std::string>& paths)
    : lock_(dir_of(paths.empty() ? std::string() : paths[0]), false) {
  refuse_torn_set(dir_of(paths.empty() ? std::string() : paths[0]), paths);
}

void install_signal_handlers() {
  static bool done = false;
  if (done) return;
  done = true;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_mask = handled_set();  // one handler at a time
  for (int sig : kHandled) {
    struct sigaction old;
    if (sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;  // e.g. SIGHUP under nohup
    sigaction(sig, &sa, nullptr);
  }
  signal(SIGXFSZ, SIG_IGN);  // a write past `ulimit -f` then fails with EFBIG and is rolled back
}

void register_temp(const std::string& path) {
  FLOWMOE_CHECK(path.size() < kMaxPath, path << ": the path is too long (at most " << kMaxPath - 1 << " bytes)");
  for (int i = 0; i < kMaxTemps; ++i) {
    if (g_used[i]) continue;
    std::memcpy(g_temps[i], path.c_str(), path.size() + 1);
    g_used[i] = 1;
    return;
  }
  FLOWMOE_CHECK(false, "internal: more than " << kMaxTemps << " temporary files at once");
}

void unregister_temp(const std::string& path) {
  for (int i = 0; i < kMaxTemps; ++i)
    if (g_used[i] && path == g_temps[i]) g_used[i] = 0;
}

SignalBlock::SignalBlock() {
  const sigset_t s = handled_set();
  sigprocmask(SIG_BLOCK, &s, &old_);
}
SignalBlock::~SignalBlock() { sigprocmask(SIG_SETMASK, &old_, nullptr); }

}  // namespace cli
}  // namespace flowmoe
