// What code outside the kernels uses of their device checks: the fault of a
// check and its conversion to a DeviceStatus, and CheckListedBlock (the
// service runs it on an EAGER Flush's block list, so that every commit mode
// refuses a list alike: server/modes/eager.cc). The checks themselves live
// in kernels/checks/ (each verb's) and in each commit mode's folder.
#ifndef SPECSTATE_KERNELS_INTERNAL_CHECKS_H_
#define SPECSTATE_KERNELS_INTERNAL_CHECKS_H_

#include "kernels/checks/rows.h"

#endif  // SPECSTATE_KERNELS_INTERNAL_CHECKS_H_
