// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * Do not edit: generated from Documentation/netlink/specs/gpupin.yaml
 * by scripts/gen-netlink-header.py; run `make netlink-header`.
 */

/*
 * The request policies and the ops of the generic-netlink family "gpupin":
 * what each command accepts (validated strictly: unknown attributes are
 * errors) and who may send it.  The handlers and the family are written by
 * hand.
 */
#include <net/genetlink.h>
#include <net/netlink.h>

#include "netlink-gen.h"

/* Commands that take no attributes: any attribute is rejected. */
static const struct nla_policy gpupin_no_attrs_nl_policy[GPUPIN_NL_A_PID + 1] = {
	[GPUPIN_NL_A_PID] = { .type = NLA_REJECT },
};

/* GPUPIN_NL_CMD_GET_PINS - dump */
static const struct nla_policy gpupin_get_pins_nl_policy[GPUPIN_NL_A_PID + 1] = {
	[GPUPIN_NL_A_PID] = NLA_POLICY_MIN(NLA_U32, 1),
};

/* GPUPIN_NL_CMD_GET_PIN - do */
static const struct nla_policy gpupin_get_pin_nl_policy[GPUPIN_NL_A_HANDLE + 1] = {
	[GPUPIN_NL_A_PID] = { .type = NLA_U32 },
	[GPUPIN_NL_A_HANDLE] = { .type = NLA_U64 },
};

/*
 * One op per command that takes requests, in command order.  Each is a do or a
 * dump, never both, so plain genl_ops with a policy each validate exactly what
 * split ops would, and exist on older kernels too.
 */
const struct genl_ops gpupin_nl_ops[5] = {
	{
		.cmd = GPUPIN_NL_CMD_GET_INFO,
		.doit = gpupin_nl_get_info_doit,
		.policy = gpupin_no_attrs_nl_policy,
		.maxattr = GPUPIN_NL_A_PID,
	},
	{
		.cmd = GPUPIN_NL_CMD_GET_PINS,
		.dumpit = gpupin_nl_get_pins_dumpit,
		.policy = gpupin_get_pins_nl_policy,
		.maxattr = GPUPIN_NL_A_PID,
	},
	{
		.cmd = GPUPIN_NL_CMD_GET_STATS,
		.doit = gpupin_nl_get_stats_doit,
		.policy = gpupin_no_attrs_nl_policy,
		.maxattr = GPUPIN_NL_A_PID,
	},
	{
		.cmd = GPUPIN_NL_CMD_GET_PIN,
		.doit = gpupin_nl_get_pin_doit,
		.policy = gpupin_get_pin_nl_policy,
		.maxattr = GPUPIN_NL_A_HANDLE,
	},
	{
		.cmd = GPUPIN_NL_CMD_SUBSCRIBE,
		.doit = gpupin_nl_subscribe_doit,
		.flags = GENL_ADMIN_PERM,
		.policy = gpupin_no_attrs_nl_policy,
		.maxattr = GPUPIN_NL_A_PID,
	},
};
