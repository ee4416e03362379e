// common/comm/mesh.h — the rank grid of lesson 08: DP × PP × CP × TP on the world's ranks,
// with EP folded onto the same ranks, and one Comm per axis.
//
// It lives in common/comm/ because it is communication topology: it says which ranks talk to
// which, and builds those communicators with Comm::split. The layers that use the groups
// (TP matmuls, ZeRO, the pipeline, the MoE dispatch) stay in the lesson and common/layers/.
//
// Design rule: everything about the layout (coordinates, groups, names, the size check) is a
// pure function of the sizes, usable and testable without MPI; the Mesh class only turns
// those groups into communicators.
//
// ---- the order
// Megatron-LM's (megatron/core/parallel_state.py, RankGenerator, order "tp-cp-ep-dp-pp"):
// tp varies fastest, then cp, then dp, then pp:
//     rank  = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
//     world = dp * pp * cp * tp
// So the ranks of one TP group are neighbours (one node: TP's collectives sit on the critical
// path and want the fastest links), and one pipeline stage is a block of world / pp
// consecutive ranks. E.g. tp 2, dp 2: tp groups [0 1] [2 3], dp groups [0 2] [1 3].
//
// ---- EP, folded (Megatron's "MoE parallel folding")
// EP adds no ranks of its own (a formula like "world = DP x TP x PP x CP x EP" counts them
// twice). Within each pipeline stage, the world / pp ranks that the dense layers see as
// dp × cp × tp are regrouped for the MoE layers as expert-TP × EP × expert-DP, in that order
// (fastest first), with expert-TP = 1 here (experts are not split by TP, as in DeepSeek-V3).
// With s = rank mod (world / pp), the rank's position in its stage:
//     ep_i  = s mod ep          edp_i = s / ep          edp = world / (pp * ep)
// An EP group is ep consecutive ranks of one stage, each holding its own share of the
// experts (tokens travel between them by all-to-all); an expert-DP group ("edp") is the ranks
// of one stage that hold the same experts (their expert gradients are summed over it).
// The rule: ep must divide world / pp = dp * cp * tp (Megatron's: world divisible by
// expert_tp * ep * pp). With ep = 1 every rank holds every expert and edp is the whole stage.
#pragma once
#include <string>
#include <vector>

#include "common/comm/comm.h"

namespace ff {

// The size of every axis. world() = dp * pp * cp * tp; ep is folded onto those ranks.
struct MeshSizes {
  int tp = 1, cp = 1, ep = 1, dp = 1, pp = 1;
  int world() const { return dp * pp * cp * tp; }
};

// A rank's place: its index along every axis (0 <= tp < sizes.tp, ...; edp < world / (pp*ep)).
struct MeshCoords {
  int tp = 0, cp = 0, ep = 0, dp = 0, pp = 0, edp = 0;
};
bool operator==(const MeshCoords& a, const MeshCoords& b);

// The groups a rank belongs to. dp_cp is DP and CP together (dense gradients are reduced
// over it: CP ranks hold the same weights and see different tokens, as DP ranks do), indexed
// dp_i * cp + cp_i (cp faster, as in the world order).
enum class MeshAxis { tp, cp, ep, dp, pp, dp_cp, edp };
constexpr MeshAxis kMeshAxes[] = {MeshAxis::tp, MeshAxis::cp, MeshAxis::dp,  MeshAxis::pp,
                                  MeshAxis::dp_cp, MeshAxis::ep, MeshAxis::edp};
const char* mesh_axis_name(MeshAxis a);  // "tp", "cp", "ep", "dp", "pp", "dp-cp", "edp"

// "" when the sizes fit a world of `world` ranks, else one sentence saying what is wrong, e.g.
//   "dp 2 x pp 1 x cp 1 x tp 2 = 4, but the world has 6 ranks"
//   "tp is 0, but every mesh size must be at least 1"
//   "ep 3 must divide dp x cp x tp = 4, the ranks of one pipeline stage that the experts are spread over"
// Lessons print it as their one `error:` line, before any MPI work.
std::string check_mesh(const MeshSizes& s, int world);

// World rank <-> coordinates (sizes as check_mesh accepts them). mesh_rank reads tp, cp, dp
// and pp only: ep and edp follow from the rank.
MeshCoords mesh_coords(const MeshSizes& s, int rank);
int mesh_rank(const MeshSizes& s, const MeshCoords& c);
int mesh_axis_size(const MeshSizes& s, MeshAxis a);          // ranks per group of that axis
int mesh_axis_index(const MeshSizes& s, const MeshCoords& c, MeshAxis a);  // index in its group

// Every group of an axis as world ranks, member i at position i (its index along the axis),
// groups ordered by their first rank.
std::vector<std::vector<int>> mesh_groups(const MeshSizes& s, MeshAxis a);

// A rank's printable name: the axis sizes, then its world rank,
//   "DP(2)-PP(1)-CP(1)-TP(2)-EP(1)-Rank(3)"
std::string mesh_name(const MeshSizes& s, int rank);

// Every group of every axis, one line per axis in kMeshAxes's order (lesson 08's
// --print-mesh), e.g. for tp 2, dp 2:
//      tp groups: [0 1] [2 3]
//      cp groups: [0] [1] [2] [3]
//      dp groups: [0 2] [1 3]
//   ...
std::string mesh_groups_text(const MeshSizes& s);

// ---- the mesh on a communicator
// Built collectively by every rank of `world` (the same sizes everywhere). Refuses
// (ff::Error, check_mesh's sentence) sizes that do not fit world.size(), before any MPI call.
// Each axis communicator comes from world.split(color = the group's first world rank,
// key = the index along the axis), so rank i of tp() has coordinate tp = i, and so on; each is
// labelled with its axis's name, so its trace spans and watchdog messages say which axis.
class Mesh {
 public:
  Mesh(const Comm& world, const MeshSizes& sizes);

  const MeshSizes& sizes() const { return sizes_; }
  const MeshCoords& coords() const { return coords_; }
  int rank() const { return world_.rank(); }  // the world rank
  std::string name() const { return mesh_name(sizes_, rank()); }

  Comm& world() { return world_; }
  Comm& tp() { return tp_; }
  Comm& cp() { return cp_; }
  Comm& ep() { return ep_; }
  Comm& dp() { return dp_; }
  Comm& pp() { return pp_; }
  Comm& dp_cp() { return dp_cp_; }
  Comm& edp() { return edp_; }
  Comm& axis(MeshAxis a);

 private:
  MeshSizes sizes_;
  MeshCoords coords_;
  Comm world_, tp_, cp_, ep_, dp_, pp_, dp_cp_, edp_;
};

}  // namespace ff
