/* LD_PRELOAD shim for `bench/run.py --reverse-dns numeric`: getnameinfo() never asks DNS.
 *
 * torch's TCPStore formats every socket address it accepts or connects with getnameinfo()
 * (c10d socket.cpp, formatSockAddr), a reverse DNS query each. Where the resolver answers
 * PTR queries promptly (a cluster's DNS answers for pod IPs) that costs about a
 * millisecond; this machine's resolver drops bursts of them, and every drop costs glibc's
 * 5 s timeout. The shim gives the answer a prompt resolver would give for an address with
 * no name (the number), so the benchmark can show the rendezvous without this machine's
 * DNS. It is loaded into the simulated nodes of every backend alike. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <stddef.h>
#include <sys/socket.h>

typedef int (*getnameinfo_fn)(const struct sockaddr *, socklen_t, char *, socklen_t, char *,
                              socklen_t, int);

int getnameinfo(const struct sockaddr *addr, socklen_t addrlen, char *host, socklen_t hostlen,
                char *serv, socklen_t servlen, int flags) {
    static getnameinfo_fn real;
    if (real == NULL) {
        real = (getnameinfo_fn)dlsym(RTLD_NEXT, "getnameinfo");
    }
    return real(addr, addrlen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST);
}
