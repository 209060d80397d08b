/* kvtier.worker._copyruns: copy a batch of byte runs with memcpy, on a few threads, with the
 * GIL released once for the whole batch.
 *
 * Why (see memmove.py): copying run by run with ctypes.memmove retakes the GIL after every
 * run, so a Python thread spinning beside the copies (an engine's forward pass, between torch
 * ops) slowed them to 0.05 GB/s; and two Python threads each looping over their runs reached
 * ~0.7 of one contiguous torch copy on the 2-core development machine.
 *
 * copy_runs(dst, src, nbytes, num_threads=1) -> None
 *     dst, src: addresses (C-contiguous 1-D int64 buffers, e.g. numpy int64 arrays);
 *     nbytes: run lengths (same kind, same length, each >= 0). Run i copies nbytes[i] bytes
 *     from src[i] to dst[i]; destinations must not overlap each other or any source.
 *     The total bytes are cut into num_threads equal shares (a run may be cut in pieces);
 *     the calling thread copies the first share, num_threads - 1 new threads the others.
 *     Raises ValueError for malformed arguments, before anything is copied.
 *
 * Copier(num_threads): num_threads pthreads that copy started batches in order, never taking
 * the GIL, so consecutive batches copy back to back however busy the interpreter is.
 *     start(dst, src, nbytes, num_shares) -> ticket: queue a batch (same arguments as
 *         copy_runs; num_shares <= num_threads pieces) and return at once. The arrays are held
 *         (buffer protocol) until `wait`.
 *     wait(ticket) -> (float, bool): block, without the GIL, until no thread copies that batch
 *         any more; returns the seconds from `start` to that moment, and True when every byte
 *         was copied (False: a cancel cut it short). Every ticket must be waited for once.
 *     cancel(ticket) -> bool: cut a started batch short: its threads stop before their next
 *         run, and every CANCEL_SLICE_BYTES inside a long run, so a cancel takes effect within
 *         one MiB of copying. False when the ticket is unknown or already waited for.
 *     close(): copy what was started, stop the threads (idempotent; also on deallocation).
 *     Thread-safety: start and wait from one thread at a time (the owner's job thread);
 *     cancel from any thread.
 *
 * Memory safety is the caller's: the addresses are not checked beyond "not null".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAMING_STORES 1
#endif

#define MAX_THREADS 64
/* Runs at least this long are written with non-temporal (streaming) stores: the bytes are
 * not read again soon (a slab slot, or engine blocks the next forward pass reads once), and
 * skipping the read-for-ownership of each destination line saves a third of the memory
 * traffic. Measured on the 2-core development machine: 2 MiB chunks went from ~0.78 to ~1.0
 * of a contiguous torch copy (which writes through the cache). */
#define STREAM_MIN_BYTES (64 * 1024)
/* A cancel is checked before every run and between slices of this size inside a long run: a
 * relaxed load of a flag nobody writes while the batch copies, so it costs nothing measurable,
 * and a cancelled batch stops within a slice (measured on the 2-core development machine:
 * cancel -> wait returned in 0.19 ms median; issue #20: a copy past its job's deadline must
 * stop before the forward pass reuses its blocks). */
#define CANCEL_SLICE_BYTES (1 << 20)

static void copy_bytes(char *dst, const char *src, size_t len)
{
#ifdef HAVE_STREAMING_STORES
    if (len >= STREAM_MIN_BYTES) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, len -= head;
        size_t blocks = len / 64;
        for (size_t i = 0; i < blocks; i++, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, len % 64);
        _mm_sfence(); /* streaming stores are weakly ordered: visible before the copy reports done */
        return;
    }
#endif
    memcpy(dst, src, len);
}

typedef struct {
    const int64_t *dst, *src, *nbytes;
    Py_ssize_t num_runs;
    Py_ssize_t first_run; /* the run this share starts in */
    int64_t skip;         /* bytes of first_run that belong to the previous share */
    int64_t bytes;        /* bytes this share copies */
    const int *cancelled; /* set (relaxed) to stop the share early; NULL: never cancelled */
} Share;

static int is_cancelled(const int *flag)
{
    return flag != NULL && __atomic_load_n(flag, __ATOMIC_RELAXED);
}

/* Copy the share; returns 1 when a cancel stopped it with bytes left, else 0. */
static int copy_share(const Share *s)
{
    int64_t left = s->bytes, skip = s->skip;
    for (Py_ssize_t i = s->first_run; left > 0 && i < s->num_runs; i++) {
        int64_t len = s->nbytes[i] - skip;
        if (len > left)
            len = left;
        char *dst = (char *)(intptr_t)s->dst[i] + skip;
        const char *src = (const char *)(intptr_t)s->src[i] + skip;
        left -= len;
        skip = 0;
        while (len > 0) {
            if (is_cancelled(s->cancelled))
                return 1;
            int64_t piece = len < CANCEL_SLICE_BYTES ? len : CANCEL_SLICE_BYTES;
            copy_bytes(dst, src, (size_t)piece);
            dst += piece, src += piece, len -= piece;
        }
    }
    return 0;
}

static void *copy_share_thread(void *arg)
{
    copy_share((const Share *)arg);
    return NULL;
}

/* Share k covers bytes [total * k / n, total * (k + 1) / n) of the runs laid end to end. */
static void cut_shares(Share *shares, int num_shares, const int64_t *nbytes, Py_ssize_t num_runs, int64_t total)
{
    int64_t begin[MAX_THREADS + 1], q = total / num_shares, r = total % num_shares;
    for (int k = 0; k <= num_shares; k++)
        begin[k] = q * k + r * k / num_shares; /* total * k / num_shares without overflow */
    shares[0].first_run = 0;
    shares[0].skip = 0;
    int k = 1;
    int64_t pos = 0; /* byte position where run i starts */
    for (Py_ssize_t i = 0; i < num_runs && k < num_shares; i++) {
        while (k < num_shares && begin[k] < pos + nbytes[i]) {
            shares[k].first_run = i;
            shares[k].skip = begin[k] - pos;
            k++;
        }
        pos += nbytes[i];
    }
    for (; k < num_shares; k++) { /* only when total == 0, which callers skip */
        shares[k].first_run = num_runs;
        shares[k].skip = 0;
    }
    for (k = 0; k < num_shares; k++)
        shares[k].bytes = begin[k + 1] - begin[k];
}

static void copy_all(Share *shares, int num_shares)
{
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int k = 1; k < num_shares; k++)
        started[k] = pthread_create(&threads[k], NULL, copy_share_thread, &shares[k]) == 0;
    copy_share(&shares[0]);
    for (int k = 1; k < num_shares; k++) {
        if (started[k])
            pthread_join(threads[k], NULL);
        else
            copy_share(&shares[k]); /* no thread to be had: copy it here, slower but correct */
    }
}

static int is_int64_format(const char *format)
{
    if (format == NULL)
        return 0; /* plain bytes: not an int64 array */
    if (*format == '@' || *format == '=' || *format == (PY_LITTLE_ENDIAN ? '<' : '>'))
        format++;
    return (format[0] == 'q' || format[0] == 'l') && format[1] == '\0';
}

static int get_int64_array(PyObject *obj, const char *name, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous 1-D int64 array (e.g. numpy int64), got %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (view->ndim != 1 || view->itemsize != 8 || !is_int64_format(view->format)) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D int64 array, got format '%s', itemsize %zd, ndim %d", name,
                     view->format ? view->format : "B", view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Total bytes of the runs, or -1 with ValueError set for a negative length, a null address
 * or an int64 overflow. */
static int64_t checked_total(const int64_t *dst, const int64_t *src, const int64_t *nbytes, Py_ssize_t num_runs)
{
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < num_runs; i++) {
        if (nbytes[i] < 0 || nbytes[i] > INT64_MAX - total) {
            PyErr_Format(PyExc_ValueError, "nbytes[%zd] = %lld: lengths must be >= 0 and sum below 2**63", i,
                         (long long)nbytes[i]);
            return -1;
        }
        if (nbytes[i] > 0 && (dst[i] == 0 || src[i] == 0)) {
            PyErr_Format(PyExc_ValueError, "run %zd has a null address (dst %lld, src %lld)", i, (long long)dst[i],
                         (long long)src[i]);
            return -1;
        }
        total += nbytes[i];
    }
    return total;
}

/* One batch of runs, its arrays held and cut into shares. */
typedef struct {
    Py_buffer views[3];
    int num_views;
    int num_shares; /* 0 when there is nothing to copy */
    Share shares[MAX_THREADS];
} Batch;

static void release_batch(Batch *batch)
{
    while (batch->num_views > 0)
        PyBuffer_Release(&batch->views[--batch->num_views]);
}

/* Fill `batch` from the three arrays; -1 with ValueError set (and nothing held) if malformed. */
static int open_batch(Batch *batch, PyObject *dst_obj, PyObject *src_obj, PyObject *nbytes_obj, Py_ssize_t num_shares)
{
    PyObject *objs[3] = {dst_obj, src_obj, nbytes_obj};
    const char *names[3] = {"dst", "src", "nbytes"};
    batch->num_views = 0;
    batch->num_shares = 0;
    if (num_shares < 1 || num_shares > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "num_threads must be in [1, %d], got %zd", MAX_THREADS, num_shares);
        return -1;
    }
    for (; batch->num_views < 3; batch->num_views++)
        if (get_int64_array(objs[batch->num_views], names[batch->num_views], &batch->views[batch->num_views]) < 0)
            goto fail;
    Py_ssize_t num_runs = batch->views[2].shape[0];
    if (batch->views[0].shape[0] != num_runs || batch->views[1].shape[0] != num_runs) {
        PyErr_Format(PyExc_ValueError, "dst, src and nbytes must have equal lengths, got %zd, %zd, %zd",
                     batch->views[0].shape[0], batch->views[1].shape[0], num_runs);
        goto fail;
    }
    const int64_t *dst = batch->views[0].buf, *src = batch->views[1].buf, *nbytes = batch->views[2].buf;
    int64_t total = checked_total(dst, src, nbytes, num_runs);
    if (total < 0)
        goto fail;
    if (total > 0) {
        batch->num_shares = (int)num_shares;
        for (int k = 0; k < batch->num_shares; k++)
            batch->shares[k] = (Share){dst, src, nbytes, num_runs, 0, 0, 0, NULL};
        cut_shares(batch->shares, batch->num_shares, nbytes, num_runs, total);
    }
    return 0;
fail:
    release_batch(batch);
    return -1;
}

static PyObject *copy_runs(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *keywords[] = {"dst", "src", "nbytes", "num_threads", NULL};
    PyObject *dst_obj, *src_obj, *nbytes_obj;
    Py_ssize_t num_threads = 1;
    Batch batch;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|n:copy_runs", keywords, &dst_obj, &src_obj, &nbytes_obj,
                                     &num_threads))
        return NULL;
    if (open_batch(&batch, dst_obj, src_obj, nbytes_obj, num_threads) < 0)
        return NULL;
    if (batch.num_shares > 0) {
        Py_BEGIN_ALLOW_THREADS
        copy_all(batch.shares, batch.num_shares);
        Py_END_ALLOW_THREADS
    }
    release_batch(&batch);
    Py_RETURN_NONE;
}

/* ---- Copier: persistent threads copying queued batches ---- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct Job {
    Batch batch;
    long long ticket;
    int next_share;  /* the next share a thread takes */
    int shares_left; /* shares not copied yet */
    int cancelled;   /* written by cancel, read by the copying threads (relaxed atomics) */
    int cut_short;   /* a share stopped with bytes left (under the lock) */
    double started, seconds;
    struct Job *next; /* jobs in start order, until waited for */
} Job;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t work; /* a share was queued, or closing */
    pthread_cond_t done; /* a job finished */
    Job *head, *tail;    /* started, not waited for */
    Job *pending;        /* the first job with a share no thread took yet */
    long long next_ticket;
    int num_threads, closing, is_init;
    pthread_t threads[MAX_THREADS];
} Copier;

static Job *next_pending(Job *job)
{
    while (job != NULL && job->next_share == job->batch.num_shares)
        job = job->next;
    return job;
}

static void *serve(void *arg)
{
    Copier *c = arg;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (c->pending == NULL && !c->closing)
            pthread_cond_wait(&c->work, &c->lock);
        if (c->pending == NULL)
            break; /* closing, and every started share is taken */
        Job *job = c->pending;
        Share *share = &job->batch.shares[job->next_share++];
        c->pending = next_pending(job);
        pthread_mutex_unlock(&c->lock);
        int cut = copy_share(share);
        pthread_mutex_lock(&c->lock);
        job->cut_short |= cut;
        if (--job->shares_left == 0) {
            job->seconds = now_s() - job->started;
            pthread_cond_broadcast(&c->done);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

static int Copier_init(Copier *c, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"num_threads", NULL};
    Py_ssize_t num_threads;
    if (c->is_init) {
        PyErr_SetString(PyExc_RuntimeError, "Copier is already initialized");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:Copier", keywords, &num_threads))
        return -1;
    if (num_threads < 1 || num_threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "num_threads must be in [1, %d], got %zd", MAX_THREADS, num_threads);
        return -1;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->done, NULL);
    c->is_init = 1;
    for (; c->num_threads < num_threads; c->num_threads++) {
        if (pthread_create(&c->threads[c->num_threads], NULL, serve, c) != 0) {
            if (c->num_threads > 0)
                break; /* fewer threads than asked: slower, still correct */
            PyErr_SetString(PyExc_OSError, "Copier could not start a thread");
            return -1;
        }
    }
    return 0;
}

static PyObject *Copier_start(Copier *c, PyObject *args)
{
    PyObject *dst, *src, *nbytes;
    Py_ssize_t num_shares;
    if (!PyArg_ParseTuple(args, "OOOn:start", &dst, &src, &nbytes, &num_shares))
        return NULL;
    if (c->num_threads == 0 || c->closing)
        return PyErr_Format(PyExc_RuntimeError, "Copier is closed");
    Job *job = PyMem_RawCalloc(1, sizeof(Job));
    if (job == NULL)
        return PyErr_NoMemory();
    if (open_batch(&job->batch, dst, src, nbytes, num_shares) < 0) {
        PyMem_RawFree(job);
        return NULL;
    }
    job->shares_left = job->batch.num_shares;
    for (int k = 0; k < job->batch.num_shares; k++)
        job->batch.shares[k].cancelled = &job->cancelled;
    job->started = now_s();
    /* Taken with the GIL held: nobody holds the lock for more than a few instructions, and
     * waiting for the GIL with it held would stall the copying threads. */
    pthread_mutex_lock(&c->lock);
    job->ticket = c->next_ticket++;
    if (c->tail != NULL)
        c->tail->next = job;
    else
        c->head = job;
    c->tail = job;
    if (c->pending == NULL)
        c->pending = next_pending(job);
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->lock);
    return PyLong_FromLongLong(job->ticket);
}

/* Remove and return the job of `ticket` (lock held), or NULL. */
static Job *unlink_job(Copier *c, long long ticket)
{
    Job *prev = NULL;
    for (Job *job = c->head; job != NULL; prev = job, job = job->next) {
        if (job->ticket != ticket)
            continue;
        if (prev != NULL)
            prev->next = job->next;
        else
            c->head = job->next;
        if (c->tail == job)
            c->tail = prev;
        return job;
    }
    return NULL;
}

/* Block (GIL released) until the job of `ticket` finished, and unlink it; NULL if unknown. */
static Job *wait_job(Copier *c, long long ticket)
{
    /* A finished job is taken without releasing the GIL: beside a busy Python thread, getting
     * it back costs a switch interval (5 ms), longer than a 32 MiB batch takes to copy. */
    pthread_mutex_lock(&c->lock);
    Job *job = c->head;
    while (job != NULL && job->ticket != ticket)
        job = job->next;
    if (job != NULL && job->shares_left > 0) {
        pthread_mutex_unlock(&c->lock);
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&c->lock);
        while (job->shares_left > 0)
            pthread_cond_wait(&c->done, &c->lock);
        pthread_mutex_unlock(&c->lock);
        Py_END_ALLOW_THREADS
        pthread_mutex_lock(&c->lock);
    }
    if (job != NULL)
        unlink_job(c, ticket);
    pthread_mutex_unlock(&c->lock);
    return job;
}

static PyObject *Copier_wait(Copier *c, PyObject *arg)
{
    long long ticket = PyLong_AsLongLong(arg);
    if (ticket == -1 && PyErr_Occurred())
        return NULL;
    Job *job = c->is_init ? wait_job(c, ticket) : NULL;
    if (job == NULL)
        return PyErr_Format(PyExc_ValueError, "no started copy has ticket %lld (or it was waited for)", ticket);
    double seconds = job->seconds;
    int is_complete = !job->cut_short;
    release_batch(&job->batch);
    PyMem_RawFree(job);
    return Py_BuildValue("(dO)", seconds, is_complete ? Py_True : Py_False);
}

static PyObject *Copier_cancel(Copier *c, PyObject *arg)
{
    long long ticket = PyLong_AsLongLong(arg);
    if (ticket == -1 && PyErr_Occurred())
        return NULL;
    if (!c->is_init)
        Py_RETURN_FALSE;
    /* Taken with the GIL held, like in start: the lock is only ever held for a few instructions. */
    pthread_mutex_lock(&c->lock);
    Job *job = c->head;
    while (job != NULL && job->ticket != ticket)
        job = job->next;
    if (job != NULL)
        __atomic_store_n(&job->cancelled, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&c->lock);
    return PyBool_FromLong(job != NULL);
}

static void close_copier(Copier *c)
{
    if (!c->is_init || c->num_threads == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);
    c->closing = 1;
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->lock);
    for (int k = 0; k < c->num_threads; k++)
        pthread_join(c->threads[k], NULL);
    Py_END_ALLOW_THREADS
    c->num_threads = 0;
    while (c->head != NULL) { /* started, never waited for: copied by now */
        Job *job = c->head;
        c->head = job->next;
        release_batch(&job->batch);
        PyMem_RawFree(job);
    }
    c->tail = c->pending = NULL;
}

static PyObject *Copier_close(Copier *c, PyObject *unused)
{
    (void)unused;
    close_copier(c);
    Py_RETURN_NONE;
}

static void Copier_dealloc(Copier *c)
{
    close_copier(c);
    if (c->is_init) {
        pthread_cond_destroy(&c->done);
        pthread_cond_destroy(&c->work);
        pthread_mutex_destroy(&c->lock);
    }
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef copier_methods[] = {
    {"start", (PyCFunction)Copier_start, METH_VARARGS,
     "start(dst, src, nbytes, num_shares) -> ticket: queue a batch of runs (see copy_runs), return at once."},
    {"wait", (PyCFunction)Copier_wait, METH_O,
     "wait(ticket) -> (seconds, is_complete): block without the GIL until no thread copies that batch;\n"
     "seconds from start to then, and False when a cancel cut it short."},
    {"cancel", (PyCFunction)Copier_cancel, METH_O,
     "cancel(ticket) -> bool: stop that batch before its next run or MiB; False if unknown or waited for."},
    {"close", (PyCFunction)Copier_close, METH_NOARGS, "close(): finish the started batches, stop the threads."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.worker._copyruns.Copier",
    .tp_basicsize = sizeof(Copier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Copier(num_threads): threads that copy started batches of runs in order, without the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Copier_init,
    .tp_dealloc = (destructor)Copier_dealloc,
    .tp_methods = copier_methods,
};

static PyMethodDef methods[] = {
    {"copy_runs", (PyCFunction)(void (*)(void))copy_runs, METH_VARARGS | METH_KEYWORDS,
     "copy_runs(dst, src, nbytes, num_threads=1)\n--\n\n"
     "Copy nbytes[i] bytes from address src[i] to dst[i] for every i (int64 arrays), the total\n"
     "split evenly over num_threads threads, without the GIL. Raises ValueError for bad arguments."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.worker._copyruns", "Batched byte-run copies without the GIL.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copyruns(void)
{
    if (PyType_Ready(&CopierType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CopierType);
    if (PyModule_AddObject(m, "Copier", (PyObject *)&CopierType) < 0) {
        Py_DECREF(&CopierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
