/* The running kernel's version: the loader passes -DLINUX_VERSION_CODE from
 * uname, as only a real tree's generated header would know it. */
#ifndef LINUX_VERSION_CODE
#error "LINUX_VERSION_CODE: the loader passes it with these headers"
#endif
#define KERNEL_VERSION(a, b, c) (((a) << 16) + ((b) << 8) + ((c) > 255 ? 255 : (c)))
