/* Records the name of every variable read through getenv and secure_getenv (one a line, appended to the file
 * ENVREC_LOG names), for tests/test_dist_check_forkserver.py: loaded with LD_PRELOAD into an interpreter
 * that starts as a fork server does, it shows which variables that start reads. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
static int log_fd = -1;
static char *(*real_getenv)(const char *);
static char *(*real_secure_getenv)(const char *);
__attribute__((constructor)) static void start(void) {
  real_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
  real_secure_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "secure_getenv");
  const char *path = real_getenv("ENVREC_LOG");
  if (path) log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
}
static void note(const char *name) {
  if (log_fd >= 0 && name) { write(log_fd, name, strlen(name)); write(log_fd, "\n", 1); }
}
char *getenv(const char *name) { note(name); return real_getenv(name); }
char *secure_getenv(const char *name) { note(name); return real_secure_getenv(name); }
