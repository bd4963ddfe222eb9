/* The ceiling of a first read through FUSE on this machine, for tools/bench-mount.
 *
 * A libfuse 3 server with one read-only file, /data, that does no work of its own: every READ
 * is answered from one 1 MiB buffer filled once (mode "mem", the best a server that copies its
 * bytes can do), or spliced from a plain file already in the page cache (mode "splice", libfuse's
 * FUSE_BUF_IS_FD reply with splice write and move, the best any server can do without FUSE
 * passthrough, which needs a backing file ksfs's compressed chunks are not). What `cat` of /data
 * reaches on a fresh mount bounds every FUSE filesystem's first read here, ksfs's included.
 *
 * Build: gcc -O2 -o fuse-ceiling tools/fuse-ceiling.c $(pkg-config --cflags --libs fuse3)
 * Run:   fuse-ceiling MNT SIZE_BYTES mem|splice:FILE [libfuse options, e.g. -f]
 */
#define FUSE_USE_VERSION 31
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static off_t data_size;
static int splice_fd = -1;
static char block[1 << 20];

static void *on_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
    (void)cfg;
    if (splice_fd >= 0)
        conn->want |= FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE;
    return NULL;
}

static int on_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
    (void)fi;
    memset(st, 0, sizeof(*st));
    if (strcmp(path, "/") == 0) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
    } else if (strcmp(path, "/data") == 0) {
        st->st_mode = S_IFREG | 0444;
        st->st_nlink = 1;
        st->st_size = data_size;
    } else {
        return -ENOENT;
    }
    return 0;
}

static int on_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
    (void)off; (void)fi; (void)flags;
    if (strcmp(path, "/") != 0)
        return -ENOENT;
    fill(buf, ".", NULL, 0, 0);
    fill(buf, "..", NULL, 0, 0);
    fill(buf, "data", NULL, 0, 0);
    return 0;
}

static int on_open(const char *path, struct fuse_file_info *fi)
{
    if (strcmp(path, "/data") != 0)
        return -ENOENT;
    if ((fi->flags & O_ACCMODE) != O_RDONLY)
        return -EACCES;
    fi->keep_cache = 1;
    return 0;
}

static int on_read(const char *path, char *buf, size_t size, off_t off,
                   struct fuse_file_info *fi)
{
    (void)path; (void)fi;
    if (off >= data_size)
        return 0;
    if ((off_t)size > data_size - off)
        size = data_size - off;
    for (size_t done = 0; done < size;) {
        size_t n = size - done < sizeof(block) ? size - done : sizeof(block);
        memcpy(buf + done, block, n);
        done += n;
    }
    return (int)size;
}

static int on_read_buf(const char *path, struct fuse_bufvec **out, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    (void)path; (void)fi;
    if (off >= data_size)
        size = 0;
    else if ((off_t)size > data_size - off)
        size = data_size - off;
    struct fuse_bufvec *vec = malloc(sizeof(*vec));
    if (vec == NULL)
        return -ENOMEM;
    *vec = FUSE_BUFVEC_INIT(size);
    vec->buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
    vec->buf[0].fd = splice_fd;
    /* The splice source repeats over the request's offset: it need not be as large as /data. */
    vec->buf[0].pos = 0;
    *out = vec;
    return 0;
}

int main(int argc, char *argv[])
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s MNT SIZE_BYTES mem|splice:FILE [libfuse options]\n", argv[0]);
        return 2;
    }
    data_size = strtoll(argv[2], NULL, 10);
    for (size_t i = 0; i < sizeof(block); i++)
        block[i] = (char)(i * 2654435761u >> 13);
    static struct fuse_operations ops = {
        .init = on_init, .getattr = on_getattr, .readdir = on_readdir,
        .open = on_open, .read = on_read,
    };
    if (strncmp(argv[3], "splice:", 7) == 0) {
        splice_fd = open(argv[3] + 7, O_RDONLY);
        if (splice_fd < 0) {
            perror(argv[3] + 7);
            return 2;
        }
        ops.read_buf = on_read_buf;
    } else if (strcmp(argv[3], "mem") != 0) {
        fprintf(stderr, "mode must be mem or splice:FILE, not %s\n", argv[3]);
        return 2;
    }
    /* fuse_main wants: prog [options] MNT */
    char *args[argc];
    int n = 0;
    args[n++] = argv[0];
    for (int i = 4; i < argc; i++)
        args[n++] = argv[i];
    args[n++] = argv[1];
    return fuse_main(n, args, &ops, NULL);
}
