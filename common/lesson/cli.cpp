// common/lesson/cli.cpp — flag parsing (see cli.h).
#include "common/lesson/cli.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "common/comm/comm.h"

namespace ff {

Cli::Cli(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

static std::string fmt_double(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

Cli::Flag& Cli::add(const std::string& name, Kind kind, void* value, const std::string& help) {
  flags_.push_back(Flag{name, help, kind, value, 0, 0, 0, 0, {}, "", ""});
  return flags_.back();
}

void Cli::flag(const std::string& name, int64_t* value, const std::string& help, int64_t min,
               int64_t max) {
  Flag& f = add(name, Kind::integer, value, help);
  f.imin = min;
  f.imax = max;
  f.default_text = std::to_string(*value);
}

void Cli::flag(const std::string& name, double* value, const std::string& help, double min,
               double max) {
  Flag& f = add(name, Kind::real, value, help);
  f.min = min;
  f.max = max;
  f.default_text = fmt_double(*value);
}

void Cli::flag(const std::string& name, std::string* value, const std::string& help,
               const std::string& metavar) {
  Flag& f = add(name, Kind::text, value, help);
  f.metavar = metavar;
  f.default_text = value->empty() ? "off" : *value;
}

void Cli::choice(const std::string& name, std::string* value,
                 const std::vector<std::string>& allowed, const std::string& help) {
  Flag& f = add(name, Kind::choice, value, help);
  f.allowed = allowed;
  f.default_text = *value;
}

void Cli::toggle(const std::string& name, bool* value, const std::string& help) {
  Flag& f = add(name, Kind::toggle, value, help);
  f.default_text = *value ? "on" : "off";
}

static std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); i++) s += (i ? sep : "") + v[i];
  return s;
}

std::string Cli::set(const Flag& f, const std::string& text) {
  switch (f.kind) {
    case Kind::integer: {
      errno = 0;
      char* end = nullptr;
      long long v = std::strtoll(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || errno == ERANGE)
        return f.name + " expects an integer, got '" + text + "'";
      if (v < f.imin || v > f.imax)
        return f.name + " must be in [" + std::to_string(f.imin) + ", " + std::to_string(f.imax) +
               "], got " + text;
      *static_cast<int64_t*>(f.value) = v;
      return "";
    }
    case Kind::real: {
      errno = 0;
      char* end = nullptr;
      double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
        return f.name + " expects a number, got '" + text + "'";
      if (v < f.min || v > f.max)
        return f.name + " must be in [" + fmt_double(f.min) + ", " + fmt_double(f.max) + "], got " +
               text;
      *static_cast<double*>(f.value) = v;
      return "";
    }
    case Kind::text:
      if (text.empty()) return f.name + " expects a non-empty value";
      *static_cast<std::string*>(f.value) = text;
      return "";
    case Kind::choice:
      for (const std::string& a : f.allowed)
        if (a == text) {
          *static_cast<std::string*>(f.value) = text;
          return "";
        }
      return f.name + " must be one of " + join(f.allowed, ", ") + "; got '" + text + "'";
    case Kind::toggle: return "";
  }
  return "";
}

// "a FILE", "one of a|b", "a number": what a flag's value is, for error lines.
std::string Cli::value_name(const Flag& f) {
  switch (f.kind) {
    case Kind::integer: return "an integer";
    case Kind::real: return "a number";
    case Kind::text: return "a " + f.metavar;
    case Kind::choice: return "one of " + join(f.allowed, "|");
    case Kind::toggle: return "no value";
  }
  return "a value";
}

std::string Cli::parse_args(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); i++) {
    std::string a = args[i];
    if (a == "--help" || a == "-h") return "help";
    std::string name = a, value;
    bool inline_value = false;
    size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      inline_value = true;
    }
    const Flag* f = nullptr;
    for (const Flag& g : flags_)
      if (g.name == name) f = &g;
    if (!f) return "unknown flag '" + a + "' (see --help for the flags of " + program_ + ")";
    given_.push_back(f->name);
    if (f->kind == Kind::toggle) {
      if (inline_value) return f->name + " is a switch and takes no value";
      *static_cast<bool*>(f->value) = true;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= args.size()) return f->name + " needs " + value_name(*f);
      value = args[++i];
      // `--trace --causal`: the value was forgotten and the next flag would be swallowed.
      if ((f->kind == Kind::text || f->kind == Kind::choice) && value.rfind("--", 0) == 0)
        return f->name + " needs " + value_name(*f) + ", got the flag '" + value + "'";
    }
    std::string err = set(*f, value);
    if (!err.empty()) return err;
  }
  return "";
}

bool Cli::given(const std::string& name) const {
  for (const std::string& g : given_)
    if (g == name) return true;
  return false;
}

std::string Cli::usage() const {
  std::ostringstream os;
  os << "usage: mpirun -np P " << program_ << " [flags]\n\n" << summary_ << "\n\nflags:\n";
  for (const Flag& f : flags_) {
    std::string lhs = f.name;
    if (f.kind == Kind::integer) lhs += " N";
    if (f.kind == Kind::real) lhs += " X";
    if (f.kind == Kind::text) lhs += " " + f.metavar;
    if (f.kind == Kind::choice) lhs += " {" + join(f.allowed, "|") + "}";
    os << "  " << lhs;
    os << std::string(lhs.size() < 28 ? 28 - lhs.size() : 1, ' ') << f.help;
    if (f.kind == Kind::integer)
      os << " [" << f.imin << ".." << f.imax << "]";
    if (f.kind == Kind::real) os << " [" << fmt_double(f.min) << ".." << fmt_double(f.max) << "]";
    os << " (default: " << f.default_text << ")\n";
  }
  os << "  --help" << std::string(22, ' ') << "print this help and exit\n";
  if (!epilog_.empty()) os << "\n" << epilog_ << "\n";
  return os.str();
}

void Cli::parse(int argc, char** argv, const Comm& comm) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string r = parse_args(args);
  if (r == "help") {
    if (comm.rank() == 0) std::fputs(usage().c_str(), stdout);
    std::fflush(stdout);
    Comm::exit_all(0);
  }
  usage_error_if(!r.empty(), comm, r);
}

void CommonFlags::add_to(Cli& cli) {
  cli.choice("--device", &device, {"auto", "cpu", "sim", "cuda"},
             "where kernels run (auto: the best available)");
  cli.choice("--backend", &backend, {"auto", "mpi", "nccl"},
             "what moves the tensors between ranks: nccl needs --device cuda (auto: nccl on cuda "
             "when built with NCCL, else mpi)");
  cli.flag("--seed", &seed, "seed of the counter-based RNG", 0, INT64_MAX);
  cli.flag("--timeout", &timeout, "watchdog: seconds without progress before a wait is an error",
           0.1, 86400.0);
  cli.flag("--dump", &dump, "directory to write inputs, outputs and gradients as .npy", "DIR");
  cli.flag("--trace", &trace, "write a Chrome/Perfetto trace JSON to this file", "FILE");
  cli.flag("--csv", &csv, "write the run's metrics to this CSV file", "FILE");
  cli.flag("--max-memory", &max_memory_gib,
           "GiB per rank the sizes may need (0: what this node has, shared by its ranks)", 0, 1e6);
}

Device CommonFlags::resolve_device(const Comm& comm) const {
  Device d = Device::cpu;
  if (device == "auto") {
    d = device_available(Device::cuda) ? Device::cuda : Device::cpu;
  } else {
    parse_device(device, &d);  // the choice flag allows only valid names
    usage_error_if(!device_available(d), comm,
                   "--device " + device + ": " + device_unavailable_reason(d) +
                       " (available: cpu, sim" +
                       (device_available(Device::cuda) ? ", cuda" : "") + ", auto)");
  }
  if (d == Device::cuda) {
    // Ranks on one node share its GPUs: the node-local rank picks one.
    MPI_Comm node;
    MPI_Comm_split_type(comm.raw(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL, &node);
    int local_rank = 0;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    device_select_gpu(local_rank);
  }
  return d;
}

void usage_error_if(bool bad, const Comm& comm, const std::string& message) {
  if (!bad) return;
  if (comm.rank() == 0) std::fprintf(stderr, "error: %s\n", message.c_str());
  std::fflush(stderr);
  Comm::exit_all(2);
}

}  // namespace ff
