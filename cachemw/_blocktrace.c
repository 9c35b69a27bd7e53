/* The hit path's trace events (cachemw.trace.block_event) written in C.

Why: a traced 4 KiB hit spent ~8k of its ~78k instructions making its event in Python (a
Struct, Python ints for the microseconds, msgspec writing it at the batch); here the line is
formatted straight into a buffer, a few hundred instructions. trace.py owns everything else:
the file, batches, spans, forks; it takes this buffer with take() when it writes a batch.

An event is written here only when the thread has no open span (trace.py marks the thread
with span_open/span_closed: the events of a span are sorted in Python before they are
written) and its arguments have the documented types; else the Python writer (the
`fallback` given to configure) takes it. Every call runs with the GIL held and never
releases it, so the buffer needs no lock. The line is the one msgspec writes
for trace.py's Block struct, byte for byte, for every name msgspec can write (a name with a
lone surrogate, which msgspec cannot, gets a JSON escape for the surrogate, as Python's json
module writes it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static char *buf = NULL;
static Py_ssize_t used = 0, cap = 0;
static Py_ssize_t events = 0, limit = 512;
static long long next_id = 1, pid = 0, offset_us = 0;
static double flush_at = 0.0;
static PyObject *fallback = NULL, *due = NULL;
static __thread long long tid_cache = 0;
static __thread int in_span = 0;
static unsigned long generation = 1; /* bumped at fork: a thread's cached tid is from before */
static __thread unsigned long tid_generation = 0;

static int reserve(Py_ssize_t more) {
    if (used + more <= cap) return 0;
    Py_ssize_t want = cap ? cap : 65536;
    while (want < used + more) want *= 2;
    char *grown = PyMem_RawRealloc(buf, want);
    if (grown == NULL) { PyErr_NoMemory(); return -1; }
    buf = grown;
    cap = want;
    return 0;
}

static char *put_int(char *p, long long v) {
    char tmp[24];
    int n = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    if (v < 0) *p++ = '-';
    do { tmp[n++] = (char)('0' + u % 10); u /= 10; } while (u);
    while (n) *p++ = tmp[--n];
    return p;
}

static const char HEX[] = "0123456789abcdef";

/* A JSON string's body, escaped as msgspec escapes it (", \, control characters; the
   short forms for \b \f \n \r \t). At most 6 bytes out per byte in. */
static char *put_str(char *p, const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') { *p++ = (char)c; continue; }
        *p++ = '\\';
        switch (c) {
        case '"': *p++ = '"'; break;
        case '\\': *p++ = '\\'; break;
        case '\b': *p++ = 'b'; break;
        case '\f': *p++ = 'f'; break;
        case '\n': *p++ = 'n'; break;
        case '\r': *p++ = 'r'; break;
        case '\t': *p++ = 't'; break;
        default:
            *p++ = 'u'; *p++ = '0'; *p++ = '0';
            *p++ = HEX[c >> 4]; *p++ = HEX[c & 15];
        }
    }
    return p;
}

/* A string that has no UTF-8 form (a lone surrogate: a file name's undecodable byte, as
   os.fsdecode holds it), code point by code point: surrogates as JSON escapes, as
   Python's json module writes them, the rest as put_str would. At most 6 bytes out per
   code point. */
static char *put_unicode(char *p, PyObject *s) {
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c < 0x80) {
            char one = (char)c;
            p = put_str(p, &one, 1);
        } else if (c < 0x800) {
            *p++ = (char)(0xC0 | (c >> 6));
            *p++ = (char)(0x80 | (c & 0x3F));
        } else if (c >= 0xD800 && c <= 0xDFFF) {
            *p++ = '\\'; *p++ = 'u';
            *p++ = HEX[(c >> 12) & 15]; *p++ = HEX[(c >> 8) & 15];
            *p++ = HEX[(c >> 4) & 15]; *p++ = HEX[c & 15];
        } else if (c < 0x10000) {
            *p++ = (char)(0xE0 | (c >> 12));
            *p++ = (char)(0x80 | ((c >> 6) & 0x3F));
            *p++ = (char)(0x80 | (c & 0x3F));
        } else {
            *p++ = (char)(0xF0 | (c >> 18));
            *p++ = (char)(0x80 | ((c >> 12) & 0x3F));
            *p++ = (char)(0x80 | ((c >> 6) & 0x3F));
            *p++ = (char)(0x80 | (c & 0x3F));
        }
    }
    return p;
}

/* The line's fixed text (every PUT below); each of its 7 integers takes at most 20 bytes,
   each string at most 6 per byte or code point. */
#define LINE_FIXED (sizeof("{\"id\":,\"name\":\"\",\"cat\":\"cachemw.read\",\"pid\":,\"tid\":" \
                           ",\"ts\":,\"dur\":,\"ph\":\"X\",\"args\":{\"tier\":\"\",\"file\":\"\"," \
                           "\"block\":,\"bytes\":}}\n") - 1)

#define PUT(lit) (memcpy(p, lit, sizeof(lit) - 1), p += sizeof(lit) - 1)

/* block_event(name, start, end, tier, path, block, nbytes) */
static PyObject *block_event(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "block_event takes 7 arguments");
        return NULL;
    }
    if (in_span) goto python;
    Py_ssize_t nname, ntier, npath;
    if (!PyUnicode_Check(args[0]) || !PyUnicode_Check(args[3]) || !PyUnicode_Check(args[4]))
        goto python;
    const char *name = PyUnicode_AsUTF8AndSize(args[0], &nname);
    const char *tier = name ? PyUnicode_AsUTF8AndSize(args[3], &ntier) : NULL;
    if (tier == NULL) goto python_clear;
    const char *path = PyUnicode_AsUTF8AndSize(args[4], &npath);
    if (path == NULL) {  /* not UTF-8: written code point by code point */
        PyErr_Clear();
        if (PyUnicode_READY(args[4]) < 0) goto python_clear;
        npath = PyUnicode_GET_LENGTH(args[4]);
    }
    /* each conversion checked before the next (one may run Python code: __float__) */
    double start = PyFloat_AsDouble(args[1]);
    if (start == -1.0 && PyErr_Occurred()) goto python_clear;
    double end = PyFloat_AsDouble(args[2]);
    if (end == -1.0 && PyErr_Occurred()) goto python_clear;
    if (PyBool_Check(args[5]) || PyBool_Check(args[6])) goto python;  /* msgspec: true/false */
    long long block = PyLong_AsLongLong(args[5]);
    if (block == -1 && PyErr_Occurred()) goto python_clear;
    long long nbytes = PyLong_AsLongLong(args[6]);
    if (nbytes == -1 && PyErr_Occurred()) goto python_clear;
    /* microseconds that fit (and leave room for the offset); else the Python writer, which
       raises as int() does for inf and NaN */
    if (!(fabs(start) < 4e18 / 1e6 && fabs(end) < 4e18 / 1e6)) goto python;
    if (tid_generation != generation) {
        tid_cache = (long long)syscall(SYS_gettid);
        tid_generation = generation;
    }
    long long ts = (long long)(start * 1e6);
    long long dur = (long long)(end * 1e6) - ts;
    if (reserve(LINE_FIXED + 7 * 21 + 6 * (nname + ntier + npath)) < 0) return NULL;
    char *p = buf + used;
    PUT("{\"id\":"); p = put_int(p, next_id++);
    PUT(",\"name\":\""); p = put_str(p, name, nname);
    PUT("\",\"cat\":\"cachemw.read\",\"pid\":"); p = put_int(p, pid);
    PUT(",\"tid\":"); p = put_int(p, tid_cache);
    PUT(",\"ts\":"); p = put_int(p, ts + offset_us);
    PUT(",\"dur\":"); p = put_int(p, dur);
    PUT(",\"ph\":\"X\",\"args\":{\"tier\":\""); p = put_str(p, tier, ntier);
    PUT("\",\"file\":\"");
    p = path ? put_str(p, path, npath) : put_unicode(p, args[4]);
    PUT("\",\"block\":"); p = put_int(p, block);
    PUT(",\"bytes\":"); p = put_int(p, nbytes);
    PUT("}}\n");
    used = p - buf;
    events++;
    if ((events >= limit || end > flush_at) && due != NULL) {
        PyObject *r = PyObject_CallNoArgs(due);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
python_clear:
    PyErr_Clear();
python:
    if (fallback == NULL) Py_RETURN_NONE;
    return PyObject_Vectorcall(fallback, args, nargs, NULL);
}

static PyObject *take(PyObject *self, PyObject *unused) {
    PyObject *data = PyBytes_FromStringAndSize(buf ? buf : "", used);
    if (data != NULL) { used = 0; events = 0; }
    return data;
}

static PyObject *new_id(PyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(next_id++);
}

static PyObject *span_open(PyObject *self, PyObject *unused) {
    in_span = 1;
    Py_RETURN_NONE;
}

static PyObject *span_closed(PyObject *self, PyObject *unused) {
    in_span = 0;
    Py_RETURN_NONE;
}

static PyObject *set_flush_at(PyObject *self, PyObject *arg) {
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    flush_at = t;
    Py_RETURN_NONE;
}

/* configure(fallback, due, pid, offset_us, limit) */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *fb, *dn;
    long long p, off;
    Py_ssize_t lim;
    if (!PyArg_ParseTuple(args, "OOLLn", &fb, &dn, &p, &off, &lim)) return NULL;
    Py_INCREF(fb);
    Py_XSETREF(fallback, fb);
    Py_INCREF(dn);
    Py_XSETREF(due, dn);
    pid = p;
    offset_us = off;
    limit = lim;
    Py_RETURN_NONE;
}

/* after_fork(pid): in the child, whose only thread is the one that forked. The parent's
   buffered lines are the parent's to write; ids restart; every thread's tid is looked up
   again; the forking thread is in no span of the child's. */
static PyObject *after_fork(PyObject *self, PyObject *arg) {
    long long p = PyLong_AsLongLong(arg);
    if (p == -1 && PyErr_Occurred()) return NULL;
    pid = p;
    used = 0;
    events = 0;
    next_id = 1;
    flush_at = 0.0;
    generation++;
    in_span = 0;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"block_event", (PyCFunction)(void (*)(void))block_event, METH_FASTCALL,
     "block_event(name, start, end, tier, path, block, nbytes): a block's event, buffered"},
    {"take", take, METH_NOARGS, "the buffered lines, as bytes; the buffer emptied"},
    {"new_id", new_id, METH_NOARGS, "the next event id of this process"},
    {"span_open", span_open, METH_NOARGS, "this thread's events go to the fallback"},
    {"span_closed", span_closed, METH_NOARGS, "this thread's events are written here again"},
    {"set_flush_at", set_flush_at, METH_O, "perf_counter time after which an event calls due"},
    {"configure", configure, METH_VARARGS, "configure(fallback, due, pid, offset_us, limit)"},
    {"after_fork", after_fork, METH_O, "after_fork(pid): the state of a forked child"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cachemw._blocktrace",
    "The hit path's trace events, formatted in C (see cachemw.trace).", -1, methods,
};

PyMODINIT_FUNC PyInit__blocktrace(void) {
    return PyModule_Create(&module);
}
