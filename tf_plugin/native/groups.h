// The registry of open groups the ops look groups up in (kernels.cc keeps it),
// for the other op sources of this library (xla_ops.cc).
#ifndef RDT_GROUPS_H
#define RDT_GROUPS_H

#include <string>

#include "shm_allreduce.h"

namespace rdt {

// The group registered under `name`, with a reference the caller drops
// (rdt_shm_group_release); nullptr when no such group is open.
rdt_shm_group* AcquireGroup(const std::string& name);

}  // namespace rdt

#endif
