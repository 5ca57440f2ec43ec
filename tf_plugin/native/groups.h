// What kernels.cc shares with the other op sources of this library (xla_ops.cc):
// the registry of open groups the ops look groups up in, and the reductions' codes.
#ifndef RDT_GROUPS_H
#define RDT_GROUPS_H

#include <string>

#include "shm_allreduce.h"

namespace rdt {

// The group registered under `name`, with a reference the caller drops
// (rdt_shm_group_release); nullptr when no such group is open.
rdt_shm_group* AcquireGroup(const std::string& name);

// The executor's code of a reduce_op attribute (RDT_SHM_SUM...), 0 when unknown.
int OpCode(const std::string& op);

}  // namespace rdt

#endif
