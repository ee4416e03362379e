// Flag parsing without MPI: Cli::parse_args returns "" on success, "help", or the error text.
#include <doctest/doctest.h>

#include "common/comm/nccl.h"
#include "common/lesson/cli.h"

using namespace ff;

namespace {
struct Flags {
  int64_t rows = 4;
  double timeout = 60;
  std::string order = "evenodd", dump;
  bool causal = false;
  Cli cli{"prog", "summary"};
  Flags() {
    cli.flag("--rows", &rows, "rows", 1, 100);
    cli.flag("--timeout", &timeout, "seconds", 0.1, 10);
    cli.choice("--order", &order, {"naive", "evenodd", "async"}, "send order");
    cli.flag("--dump", &dump, "dir");
    cli.toggle("--causal", &causal, "causal mask");
  }
};
}  // namespace

TEST_CASE("cli: values are parsed, with --flag value and --flag=value") {
  Flags f;
  CHECK(f.cli.parse_args({"--rows", "7", "--timeout=2.5", "--order", "async", "--causal",
                          "--dump", "out"}) == "");
  CHECK(f.rows == 7);
  CHECK(f.timeout == doctest::Approx(2.5));
  CHECK(f.order == "async");
  CHECK(f.causal);
  CHECK(f.dump == "out");
}

TEST_CASE("cli: defaults stay when flags are absent, and --help is recognised") {
  Flags f;
  CHECK(f.cli.parse_args({}) == "");
  CHECK(f.rows == 4);
  CHECK_FALSE(f.causal);
  CHECK(f.cli.parse_args({"--rows", "3", "--help"}) == "help");
}

TEST_CASE("cli: every kind of bad input gives a message naming what is allowed") {
  Flags f;
  CHECK(f.cli.parse_args({"--colz", "3"}).find("unknown flag '--colz'") != std::string::npos);
  CHECK(f.cli.parse_args({"--rows"}) == "--rows needs an integer");
  CHECK(f.cli.parse_args({"--dump"}) == "--dump needs a PATH");
  CHECK(f.cli.parse_args({"--rows", "x1"}) == "--rows expects an integer, got 'x1'");
  CHECK(f.cli.parse_args({"--rows", "3.5"}) == "--rows expects an integer, got '3.5'");
  CHECK(f.cli.parse_args({"--rows", "0"}) == "--rows must be in [1, 100], got 0");
  CHECK(f.cli.parse_args({"--rows", "101"}) == "--rows must be in [1, 100], got 101");
  CHECK(f.cli.parse_args({"--timeout", "nan"}) == "--timeout expects a number, got 'nan'");
  CHECK(f.cli.parse_args({"--timeout", "20"}) == "--timeout must be in [0.1, 10], got 20");
  CHECK(f.cli.parse_args({"--order", "ring"}) ==
        "--order must be one of naive, evenodd, async; got 'ring'");
  CHECK(f.cli.parse_args({"--causal=1"}) == "--causal is a switch and takes no value");
  CHECK(f.cli.parse_args({"--dump", ""}) == "--dump expects a non-empty value");
  CHECK(f.cli.parse_args({"--rows", "99999999999999999999"}) ==
        "--rows expects an integer, got '99999999999999999999'");
}

TEST_CASE("cli: a text or choice flag given no value does not swallow the next flag") {
  Flags f;
  CHECK(f.cli.parse_args({"--dump", "--causal"}) == "--dump needs a PATH, got the flag '--causal'");
  CHECK_FALSE(f.causal);
  CHECK(f.dump.empty());
  CHECK(f.cli.parse_args({"--order", "--rows", "3"}) ==
        "--order needs one of naive|evenodd|async, got the flag '--rows'");
  // an explicit --flag=value is taken as written, and a single dash is a value
  CHECK(f.cli.parse_args({"--dump=--odd-name"}) == "");
  CHECK(f.dump == "--odd-name");
  CHECK(f.cli.parse_args({"--dump", "-"}) == "");
}

TEST_CASE("cli: numeric flags still take negative numbers where their range allows") {
  int64_t shift = 0;
  double bias = 0;
  Cli cli{"prog", "summary"};
  cli.flag("--shift", &shift, "shift", -10, 10);
  cli.flag("--bias", &bias, "bias", -1.0, 1.0);
  CHECK(cli.parse_args({"--shift", "-3", "--bias", "-0.5"}) == "");
  CHECK(shift == -3);
  CHECK(bias == doctest::Approx(-0.5));
  CHECK(cli.parse_args({"--shift", "--bias"}) == "--shift expects an integer, got '--bias'");
  CHECK(cli.given("--shift"));
  CHECK_FALSE(Flags().cli.given("--rows"));
}

TEST_CASE("cli: usage lists every flag with its default") {
  Flags f;
  std::string u = f.cli.usage();
  for (const char* want : {"--rows N", "(default: 4)", "--timeout X", "(default: 60)",
                           "--order {naive|evenodd|async}", "(default: evenodd)", "--dump PATH",
                           "(default: off)", "--causal", "--help"})
    CHECK_MESSAGE(u.find(want) != std::string::npos, "usage lacks: " << want);
}

TEST_CASE("--backend: auto is nccl only for cuda tensors, NCCL in the build and a GPU per rank; sim emulates it") {
  Backend b = Backend::nccl;
  // mpi: always, whatever the device
  for (Device d : {Device::cpu, Device::sim, Device::cuda}) {
    b = Backend::nccl;
    CHECK(resolve_backend("mpi", d, true, true, &b) == "");
    CHECK(b == Backend::mpi);
  }
  // auto: nccl with all three, else mpi
  CHECK(resolve_backend("auto", Device::cuda, true, true, &b) == "");
  CHECK(b == Backend::nccl);
  struct Case { Device d; bool built, per_rank; };
  for (Case c : {Case{Device::cuda, false, true}, Case{Device::cuda, true, false}, Case{Device::cpu, true, true},
                 Case{Device::sim, true, true}}) {
    b = Backend::nccl;
    CHECK(resolve_backend("auto", c.d, c.built, c.per_rank, &b) == "");
    CHECK(b == Backend::mpi);
  }
  // nccl: refused with one sentence saying what is needed, *out untouched
  b = Backend::mpi;
  CHECK(resolve_backend("nccl", Device::cuda, true, true, &b) == "");
  CHECK(b == Backend::nccl);
  b = Backend::mpi;
  std::string e = resolve_backend("nccl", Device::cpu, true, true, &b);
  CHECK(e.find("needs --device cuda") != std::string::npos);
  CHECK(e.find("tensors are on cpu") != std::string::npos);
  CHECK(b == Backend::mpi);
  CHECK(e.find("or sim, where it is emulated") != std::string::npos);
  // sim: the emulation, whatever the build and the GPUs (but never by auto)
  for (bool built : {false, true})
    for (bool per_rank : {false, true}) {
      b = Backend::mpi;
      CHECK(resolve_backend("nccl", Device::sim, built, per_rank, &b) == "");
      CHECK(b == Backend::nccl);
    }
  b = Backend::mpi;
  e = resolve_backend("nccl", Device::cuda, false, true, &b);
  CHECK(e.find("this build has no NCCL") != std::string::npos);
  e = resolve_backend("nccl", Device::cuda, true, false, &b);
  CHECK(e.find("one GPU per rank") != std::string::npos);
  CHECK(b == Backend::mpi);
  CHECK(resolve_backend("gloo", Device::cpu, true, true, &b).find("expected mpi, nccl or auto") != std::string::npos);
  CHECK(std::string(backend_name(Backend::nccl)) == "nccl");
  CHECK(std::string(backend_name(Backend::mpi)) == "mpi");
}
