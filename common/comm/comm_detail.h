// common/comm/comm_detail.h — what the files of Comm (comm.cpp, node.cpp, link.cpp,
// watchdog.cpp, collectives.cpp) share among themselves; nothing outside common/comm uses it.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/util/trace.h"

namespace ff::detail {

// comm.cpp: MPI counts are int; larger messages are refused (an error naming op).
int to_count(size_t bytes, const char* op);
// Byte counts and back-to-back displacements for the v-collectives.
void counts_and_displs(const std::vector<size_t>& bytes, const char* op, std::vector<int>* counts,
                       std::vector<int>* displs);
// The trace's clock, in microseconds.
double now_us();

// node.cpp: reads FF_WAIT and measures the node; collective over MPI_COMM_WORLD (Comm::world,
// once: wait_policy_decided says whether it has).
void decide_wait_policy();
bool wait_policy_decided();

// link.cpp: the link model's clock (seconds on steady_clock), and whether a modelled request's
// time has come.
double link_now_s();
bool link_due(const Request& r, double now_s);

// watchdog.cpp: a request as a trace record [start, end), and a blocking call's one span.
Span comm_record(const std::string& name, const Request& r, const MPI_Status* status, double start,
                 double end, SpanKind kind);
void record_blocking(const Request& r, const MPI_Status& status);

}  // namespace ff::detail
