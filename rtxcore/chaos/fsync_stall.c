/* A slow disk for chaos drills, loaded into `rtx serve` with LD_PRELOAD: fsync and fdatasync go through here.
 *
 * Controlled by files in $RTX_CHAOS_CONTROL_DIR, read on every call (the drill creates and removes them while the
 * server runs):
 *   fsync_stall_ms     holds a number: every fsync first sleeps that many milliseconds (an overloaded disk);
 *   hold_tmp_fsync     while it exists, an fsync of a file whose name has ".tmp" (the journal's compaction writes
 *                      one, then renames it over the journal) waits, after creating "tmp_fsync_held", so that the
 *                      drill can kill the server in the middle of a compaction.
 * Then the real call runs. Nothing else of the process changes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int control_path(char *out, size_t size, const char *name) {
    const char *dir = getenv("RTX_CHAOS_CONTROL_DIR");
    if (dir == NULL || *dir == '\0') return 0;
    return snprintf(out, size, "%s/%s", dir, name) < (int)size;
}

static void before_sync(int fd) {
    char path[4096], target[4096], link[64];
    if (control_path(path, sizeof path, "fsync_stall_ms")) {
        FILE *f = fopen(path, "r");
        if (f != NULL) {
            long ms = 0;
            if (fscanf(f, "%ld", &ms) == 1 && ms > 0) sleep_ms(ms);
            fclose(f);
        }
    }
    if (control_path(path, sizeof path, "hold_tmp_fsync") && access(path, F_OK) == 0) {
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n > 0) {
            target[n] = '\0';
            if (strstr(target, ".tmp") != NULL) {
                char held[4096];
                if (control_path(held, sizeof held, "tmp_fsync_held")) {
                    int h = open(held, O_CREAT | O_WRONLY, 0600);
                    if (h >= 0) close(h);
                }
                while (access(path, F_OK) == 0) sleep_ms(10);
            }
        }
    }
}

int fsync(int fd) {
    static int (*real)(int) = NULL;
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    before_sync(fd);
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int) = NULL;
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    before_sync(fd);
    return real(fd);
}
