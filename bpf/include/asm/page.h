/* Included by bcc's helpers; nothing in it is used by our programs (bcc
 * brings its own copy of the BPF interface), so it is empty here. */
