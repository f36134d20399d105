/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * Do not edit: generated from Documentation/netlink/specs/gpupin.yaml
 * by scripts/gen-netlink-header.py; run `make netlink-header`.
 */

/*
 * The generic-netlink family "gpupin" in the kernel: the ops array (its
 * policies are in the generated source) and the handlers it names, which are
 * written by hand.
 */
#ifndef GPUPIN_NETLINK_GEN_H
#define GPUPIN_NETLINK_GEN_H

#include <net/genetlink.h>
#include "../include/uapi/gpupin_netlink.h"

int gpupin_nl_get_info_doit(struct sk_buff *skb, struct genl_info *info);
int gpupin_nl_get_pins_dumpit(struct sk_buff *skb, struct netlink_callback *cb);
int gpupin_nl_get_stats_doit(struct sk_buff *skb, struct genl_info *info);
int gpupin_nl_get_pin_doit(struct sk_buff *skb, struct genl_info *info);
int gpupin_nl_subscribe_doit(struct sk_buff *skb, struct genl_info *info);

extern const struct genl_ops gpupin_nl_ops[5];

#endif /* GPUPIN_NETLINK_GEN_H */
