/*
 * The kernel's fixed-width types, as bcc's helpers and our programs use them.
 *
 * bpf/include/ is the whole kernel tree bcc compiles against when the agent is
 * not given one (sampler/kernel/sched.py sets BCC_KERNEL_SOURCE to bpf/): the
 * programs read no kernel struct through headers (every offset comes from the
 * running kernel's BTF), so bcc's own helpers are all that needs headers, and
 * these few files are what they include. The same set serves every kernel.
 */
#ifndef _LINUX_TYPES_H
#define _LINUX_TYPES_H

typedef unsigned char __u8;
typedef signed char __s8;
typedef unsigned short __u16;
typedef signed short __s16;
typedef unsigned int __u32;
typedef signed int __s32;
typedef unsigned long long __u64;
typedef signed long long __s64;

typedef __u8 u8;
typedef __s8 s8;
typedef __u16 u16;
typedef __s16 s16;
typedef __u32 u32;
typedef __s32 s32;
typedef __u64 u64;
typedef __s64 s64;

/* Byte-order annotations: plain integers to clang without sparse. */
typedef __u16 __be16;
typedef __u16 __le16;
typedef __u32 __be32;
typedef __u32 __le32;
typedef __u64 __be64;
typedef __u64 __le64;
typedef __u16 __sum16;
typedef __u32 __wsum;

/* uapi/linux/bpf.h aligns 64-bit fields shared with 32-bit userspace. */
#define __aligned_u64 __u64 __attribute__((aligned(8)))
#define __aligned_be64 __be64 __attribute__((aligned(8)))
#define __aligned_le64 __le64 __attribute__((aligned(8)))

typedef _Bool bool;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ssize_t;
typedef __UINTPTR_TYPE__ uintptr_t;
typedef int pid_t;

#endif
