// common/comm/mesh.cpp — the rank grid (see mesh.h for the order and the EP folding).
#include "common/comm/mesh.h"

#include <cstdint>
#include <map>
#include <sstream>

#include "common/core/check.h"

namespace ff {

bool operator==(const MeshCoords& a, const MeshCoords& b) {
  return a.tp == b.tp && a.cp == b.cp && a.ep == b.ep && a.dp == b.dp && a.pp == b.pp &&
         a.edp == b.edp;
}

const char* mesh_axis_name(MeshAxis a) {
  switch (a) {
    case MeshAxis::tp: return "tp";
    case MeshAxis::cp: return "cp";
    case MeshAxis::ep: return "ep";
    case MeshAxis::dp: return "dp";
    case MeshAxis::pp: return "pp";
    case MeshAxis::dp_cp: return "dp-cp";
    case MeshAxis::edp: return "edp";
  }
  return "?";
}

// ----------------------------------------------------------------------------
// the check

std::string check_mesh(const MeshSizes& s, int world) {
  const std::pair<const char*, int> axes[] = {
      {"tp", s.tp}, {"cp", s.cp}, {"ep", s.ep}, {"dp", s.dp}, {"pp", s.pp}};
  for (const auto& [name, size] : axes)
    if (size < 1)
      return std::string(name) + " is " + std::to_string(size) +
             ", but every mesh size must be at least 1";
  std::ostringstream os;
  // in 64 bits: four sizes that each fit an int may not multiply into one
  const int64_t product = (int64_t)s.dp * s.pp * s.cp * s.tp;
  if (product != world) {
    os << "dp " << s.dp << " x pp " << s.pp << " x cp " << s.cp << " x tp " << s.tp << " = "
       << product << ", but the world has " << world << (world == 1 ? " rank" : " ranks");
    return os.str();
  }
  const int stage = s.dp * s.cp * s.tp;  // ranks of one pipeline stage
  if (stage % s.ep != 0) {
    os << "ep " << s.ep << " must divide dp x cp x tp = " << stage
       << ", the ranks of one pipeline stage that the experts are spread over";
    return os.str();
  }
  return "";
}

// ----------------------------------------------------------------------------
// coordinates

MeshCoords mesh_coords(const MeshSizes& s, int rank) {
  FF_CHECK(check_mesh(s, s.world()).empty(), "mesh_coords: " << check_mesh(s, s.world()));
  FF_CHECK(rank >= 0 && rank < s.world(),
           "mesh_coords: rank " << rank << " is not in a mesh of " << s.world() << " ranks");
  MeshCoords c;
  // tp fastest, then cp, then dp, then pp
  c.tp = rank % s.tp;
  c.cp = rank / s.tp % s.cp;
  c.dp = rank / (s.tp * s.cp) % s.dp;
  c.pp = rank / (s.tp * s.cp * s.dp);
  // EP folded: within the stage, ep fastest, then expert-DP
  const int in_stage = rank % (s.tp * s.cp * s.dp);
  c.ep = in_stage % s.ep;
  c.edp = in_stage / s.ep;
  return c;
}

int mesh_rank(const MeshSizes& s, const MeshCoords& c) {
  return ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.tp + c.tp;
}

int mesh_axis_size(const MeshSizes& s, MeshAxis a) {
  switch (a) {
    case MeshAxis::tp: return s.tp;
    case MeshAxis::cp: return s.cp;
    case MeshAxis::ep: return s.ep;
    case MeshAxis::dp: return s.dp;
    case MeshAxis::pp: return s.pp;
    case MeshAxis::dp_cp: return s.dp * s.cp;
    case MeshAxis::edp: return s.dp * s.cp * s.tp / s.ep;
  }
  return 0;
}

int mesh_axis_index(const MeshSizes& s, const MeshCoords& c, MeshAxis a) {
  switch (a) {
    case MeshAxis::tp: return c.tp;
    case MeshAxis::cp: return c.cp;
    case MeshAxis::ep: return c.ep;
    case MeshAxis::dp: return c.dp;
    case MeshAxis::pp: return c.pp;
    case MeshAxis::dp_cp: return c.dp * s.cp + c.cp;
    case MeshAxis::edp: return c.edp;
  }
  return 0;
}

// The first world rank of `rank`'s group along a: the rank whose index along a is 0 and
// whose other coordinates are rank's. It names the group (the color of Comm::split).
static int group_first(const MeshSizes& s, int rank, MeshAxis a) {
  MeshCoords c = mesh_coords(s, rank);
  switch (a) {
    case MeshAxis::tp: c.tp = 0; break;
    case MeshAxis::cp: c.cp = 0; break;
    case MeshAxis::dp: c.dp = 0; break;
    case MeshAxis::pp: c.pp = 0; break;
    case MeshAxis::dp_cp: c.dp = 0, c.cp = 0; break;
    case MeshAxis::ep: return rank - c.ep;           // ep consecutive ranks
    case MeshAxis::edp: return rank - c.edp * s.ep;  // every ep-th rank of the stage
  }
  return mesh_rank(s, c);
}

// ----------------------------------------------------------------------------
// groups and names

std::vector<std::vector<int>> mesh_groups(const MeshSizes& s, MeshAxis a) {
  std::vector<std::vector<int>> groups;
  std::map<int, size_t> by_first;  // a group's first rank -> its place in groups
  for (int r = 0; r < s.world(); r++) {
    const int first = group_first(s, r, a);
    if (!by_first.count(first)) {  // ranks ascend, so a group's first rank comes first
      by_first[first] = groups.size();
      groups.emplace_back(mesh_axis_size(s, a), -1);
    }
    groups[by_first[first]][mesh_axis_index(s, mesh_coords(s, r), a)] = r;
  }
  return groups;
}

std::string mesh_name(const MeshSizes& s, int rank) {
  std::ostringstream os;
  os << "DP(" << s.dp << ")-PP(" << s.pp << ")-CP(" << s.cp << ")-TP(" << s.tp << ")-EP(" << s.ep
     << ")-Rank(" << rank << ")";
  return os.str();
}

std::string mesh_groups_text(const MeshSizes& s) {
  std::ostringstream os;
  for (MeshAxis a : kMeshAxes) {
    std::string label = mesh_axis_name(a);
    os << std::string(5 - label.size(), ' ') << label << " groups:";
    for (const auto& g : mesh_groups(s, a)) {
      os << " [";
      for (size_t i = 0; i < g.size(); i++) os << (i ? " " : "") << g[i];
      os << "]";
    }
    os << "\n";
  }
  return os.str();
}

// ----------------------------------------------------------------------------
// the mesh on a communicator

Mesh::Mesh(const Comm& world, const MeshSizes& sizes) : sizes_(sizes), world_(world) {
  const std::string bad = check_mesh(sizes, world.size());
  FF_CHECK(bad.empty(), bad);
  coords_ = mesh_coords(sizes, world.rank());
  // One split per axis, in kMeshAxes's order on every rank (each split is collective).
  for (MeshAxis a : kMeshAxes) {
    axis(a) = world_.split(group_first(sizes, world.rank(), a), mesh_axis_index(sizes, coords_, a));
    axis(a).set_label(mesh_axis_name(a));  // its spans read "tp allreduce", "cp isend", ...
  }
}

Comm& Mesh::axis(MeshAxis a) {
  switch (a) {
    case MeshAxis::tp: return tp_;
    case MeshAxis::cp: return cp_;
    case MeshAxis::ep: return ep_;
    case MeshAxis::dp: return dp_;
    case MeshAxis::pp: return pp_;
    case MeshAxis::dp_cp: return dp_cp_;
    case MeshAxis::edp: return edp_;
  }
  throw_error(__FILE__, __LINE__, "Mesh::axis: unknown axis");
}

}  // namespace ff
