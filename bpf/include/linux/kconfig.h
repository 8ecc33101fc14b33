/* bcc includes this first, as kbuild does; its helpers refuse to compile
 * unless the kernel has the bpf() system call. A kernel without it fails at
 * load instead, with the reason. */
#define CONFIG_BPF_SYSCALL 1
